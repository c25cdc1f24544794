"""Streaming on a simulated engine: the latency model's virtual clock, wall-clock vs synchronous rounds."""

import functools

import numpy as np
import pytest

from sara import SimulatedEnv, UniformSampler, collect
from sara.allocators import make_allocator
from sara.bench.beyond import simulate
from sara.envs.sim.latency import LatencyEnv
from sara.envs.sim.latency import makespan as _makespan

STREAM = {"barrier": False}
simulate_sync = functools.partial(simulate, driver=None)
simulate_async = functools.partial(simulate, driver={**STREAM, "fill_idle": True})


def test_makespan():
    assert _makespan(np.array([3.0, 1.0, 2.0]), 4) == 3.0
    assert _makespan(np.array([1.0, 1.0, 1.0, 1.0]), 2) == 2.0
    assert _makespan(np.array([2.0, 1.0, 1.0]), 2) == 2.0


def test_fill_idle_admits_a_prompt_for_every_idle_slot():
    """Work-conserving streaming (``fill_idle``) keeps every slot busy while groups are needed; the allocator's own
    admission rule keeps fewer in flight (it sizes admission by expected commits)."""
    runs = {}
    for fill in (False, True):
        env = LatencyEnv(SimulatedEnv("u-shaped", size=3000, seed=0), latency={"slots": 64})
        res = collect(make_allocator("sara", k=8), env, UniformSampler(3000, seed=0), target_groups=32, seed=0,
                      driver={**STREAM, "fill_idle": fill})
        runs[fill] = res.stats
    assert runs[True].mean_inflight > runs[False].mean_inflight
    assert runs[True].mean_inflight > 63.0  # every slot busy but in the step's last polls
    assert runs[True].prompts_drawn > runs[False].prompts_drawn


def test_dispatch_respects_inflight_limits():
    alloc = make_allocator("sara:probe=2", k=4)
    alloc.begin_step(2, step=0)
    alloc.admit(np.array([10, 11]))
    ids = alloc.dispatch(10)
    assert sorted(ids.tolist()) == [0, 0, 1, 1]
    assert len(alloc.dispatch(10)) == 0
    closed, _ = alloc.finished(np.array([0, 0]), np.array([0.0, 1.0]))  # unit 0 mixed -> filling
    assert len(closed) == 0 and alloc.dispatch(10).tolist() == [0, 0]


@pytest.fixture(scope="module")
def runs():
    out = {}
    for name, spec, fn in (("sync", "sara", simulate_sync), ("async", "sara", simulate_async)):
        env = SimulatedEnv("u-shaped", size=6000, seed=1)
        out[name] = fn(make_allocator(spec, k=8), env, UniformSampler(6000, seed=1), target_groups=64, seed=1,
                       latency={"slots": 128})
    return out


def test_async_reaches_the_target_with_exact_accounting(runs):
    r = runs["async"]
    assert r.stop_reason == "target_reached" and r.effective_groups >= 64
    s, res = r.result.stats, r.result
    # Every started rollout ends in exactly one of committed / abandoned / discarded / aborted.
    assert r.rollouts_started == r.rollouts_finished + r.rollouts_aborted
    assert r.rollouts_finished == s.rollouts == s.committed_rollouts + s.abandoned_rollouts + s.discarded_rollouts
    assert s.rollouts == sum(g.size for g in (*res.groups, *res.abandoned, *res.discarded))
    assert r.rollouts_aborted > 0  # a streaming step always has rollouts of closed units in flight
    # Tokens: the finished rollouts' (integer) tokens plus the aborted ones' partial tokens.
    assert s.tokens == s.committed_tokens + s.abandoned_tokens + s.discarded_tokens
    assert s.tokens < r.tokens < s.tokens + r.rollouts_aborted * 4096
    assert (r.effective_groups, r.committed_groups) == (s.effective_groups, s.committed_groups)
    ids = [g.group_id for g in (*res.groups, *res.abandoned, *res.discarded)]
    assert len(ids) == len(set(ids))


def test_sync_shares_collects_numbers(runs):
    # simulate_sync is collect + a latency wrapper: the same groups as a plain collect with the same seeds.
    plain = collect(make_allocator("sara", k=8), SimulatedEnv("u-shaped", size=6000, seed=1),
                    UniformSampler(6000, seed=1), target_groups=64, seed=1)
    r = runs["sync"]
    assert r.rollouts_started == r.rollouts_finished == plain.stats.rollouts and r.rollouts_aborted == 0
    assert [g.rollouts for g in r.result.groups] == [g.rollouts for g in plain.groups]
    assert r.tokens == plain.stats.tokens


def test_async_rollouts_use_collects_seeds(runs):
    # Rollout j of a unit gets collect's seed (seed, step, prompt, occurrence, j) in both drivers, so a prompt both
    # drivers drew shares its first rollout's seed (probes are sequential) and equal seeds give equal rewards.
    def by_prompt(r):
        res = r.result
        return {g.pool_index: {x.seed: x.reward for x in g.rollouts} for g in (*res.groups, *res.abandoned, *res.discarded)}

    sync, stream = by_prompt(runs["sync"]), by_prompt(runs["async"])
    common = set(sync) & set(stream)
    assert len(common) > 50
    for p in common:
        shared = set(sync[p]) & set(stream[p])
        assert shared and all(sync[p][x] == stream[p][x] for x in shared)


def test_latency_env_clock_and_sleep_modes():
    env = SimulatedEnv("u-shaped", size=200, seed=0)
    sim = LatencyEnv(env, latency={"slots": 1, "per_token_s": 1e-3, "prefill_s": 0.0})
    sleepy = LatencyEnv(lambda: SimulatedEnv("u-shaped", size=200, seed=0), 1e-3, sleep=False)
    for e in (sim, sleepy):
        collect(make_allocator("ds", k=4), e, UniformSampler(200, seed=0), target_groups=4, seed=0)
    assert sim.tokens == sleepy.tokens > 0
    assert sim.clock == pytest.approx(sleepy.clock) == pytest.approx(1e-3 * sim.tokens)
    assert sleepy.rates is sleepy.env.rates  # other attributes forwarded


def test_async_beats_synchronous_rounds_in_wall_clock(runs):
    assert runs["async"].seconds_per_effective_group < 0.9 * runs["sync"].seconds_per_effective_group


def test_async_is_deterministic():
    def run():
        env = SimulatedEnv("u-shaped", size=2000, seed=2)
        return simulate_async(make_allocator("sara", k=8), env, UniformSampler(2000, seed=2), target_groups=16,
                              seed=2, latency={"slots": 32}).as_dict()

    assert run() == run()
