"""The driver in streaming mode (``DriverConfig(barrier=False)``): exact accounting, determinism, the rollout seeds
of synchronous rounds, out-of-order completions, aborts of closed units' rollouts, streaming uniform and DS, every
registered allocator in both modes, and streaming SARA's rollouts per effective group against synchronous SARA's on
the tiny backend. Also the tiny backend's continuous batching and the streaming scripted backend."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sara.allocators import (
    ALLOCATORS,
    SequentialAllocator,
    make_allocator,
)
from sara.config import ConfigError
from sara.driver import collect
from sara.envs.base import GenerationRequest
from sara.envs.task_env import TaskEnv
from sara.samplers import UniformSampler
from sara.seeding import derive_seeds
from sara.testing import check_backend
from sara.testing.scripted import ScriptedBackend
from sara.testing.streaming import CoinArithmetic
from sara.types import Decision

TASK = "sara/Arithmetic-v0:max_digits=2,pool_size=300,eval_size=8"
STREAM = {"barrier": False}


class Arith(CoinArithmetic):
    """``CoinArithmetic`` (right with a per-prompt probability, some prompts always, some never; 1..8 ticks per seed)
    that records the order of submissions, finishes and aborts."""

    def __init__(self, slots: int = 16) -> None:
        super().__init__(slots)
        self.events: list[tuple[str, int]] = []

    def submit(self, items, sampling):
        super().submit(items, sampling)
        self.events += [("submit", int(t)) for t, _ in items]

    def poll(self, timeout=None):
        out = super().poll(timeout)
        self.events += [("finish", t) for t, _ in out]
        return out

    def abort(self, tags):
        self.events += [("abort", int(t)) for t in tags]
        return super().abort(tags)


class Plain(ScriptedBackend):
    answer = CoinArithmetic.answer


def _env(slots: int = 16, backend=None) -> TaskEnv:
    return TaskEnv(TASK, backend if backend is not None else Arith(slots), scorer_mode="inline")


def _stream(spec: str = "sara", *, seed: int = 0, target: int = 6, slots: int = 16, k: int = 4,
            max_rollouts: int | None = None, **driver):
    env = _env(slots)
    res = collect(make_allocator(spec, k=k), env, UniformSampler(len(env.prompts), seed=seed), target_groups=target,
                  seed=seed, max_rollouts=max_rollouts, driver={**STREAM, **driver})
    return res, env


def _fingerprint(res) -> list:
    return [(g.group_id, g.decision, tuple((r.seed, r.reward, r.completion) for r in g.rollouts))
            for g in (*res.groups, *res.abandoned, *res.discarded)]


def _stats(res) -> dict:
    return {k: v for k, v in dataclasses.asdict(res.stats).items() if not k.endswith("_seconds")}


def _check_accounting(res, env) -> None:
    s, be = res.stats, env.backend
    started = len(be.submitted)
    assert started == s.rollouts + s.aborted_rollouts  # every started rollout delivered or aborted
    assert s.aborted_rollouts == len(be.aborted) and be.inflight() == 0
    groups = (*res.groups, *res.abandoned, *res.discarded)
    delivered = [(g.group_id, r.seed) for g in groups for r in g.rollouts]
    assert len(delivered) == len(set(delivered)) == s.rollouts  # each delivered rollout in exactly one group
    assert s.rollouts == s.committed_rollouts + s.abandoned_rollouts + s.discarded_rollouts
    assert s.tokens == sum(g.num_tokens for g in groups)
    finished = {t for e, t in be.events if e == "finish"}
    assert not finished & set(be.aborted)  # an aborted rollout never comes back


def test_accounting_is_exact_and_the_target_is_reached():
    res, env = _stream("sara:probe=2", target=8, slots=32)
    _check_accounting(res, env)
    s = res.stats
    assert s.stop_reason == "target_reached" and s.committed_groups >= 8
    assert s.aborted_rollouts > 0 and s.aborted_tokens >= 0  # a unit decided with its 2nd probe in flight
    assert 0 < s.mean_inflight <= 32 and s.rounds > 0


def test_two_runs_are_identical():
    a, b = _stream(seed=3)[0], _stream(seed=3)[0]
    assert _fingerprint(a) == _fingerprint(b) and _stats(a) == _stats(b)


def test_rollout_seeds_are_collects():
    # Rollout j of a unit gets (seed, step, prompt, occurrence, j): a unit's delivered rollouts have seeds j < k,
    # and the same (prompt, seed) gives the same completion under collect on the same backend.
    res, _ = _stream(seed=1, target=8)
    sync = collect(make_allocator("sara", k=4), _env(backend=Plain()), UniformSampler(300, seed=1), target_groups=8,
                   seed=1)
    for g in (*res.groups, *res.abandoned, *res.discarded):
        allowed = derive_seeds(1, 0, g.pool_index, 0, np.arange(4)).tolist()  # step 0, occurrence 0
        assert {r.seed for r in g.rollouts} <= set(allowed)
    by_seed = {(g.pool_index, r.seed): r.completion for g in (*sync.groups, *sync.abandoned, *sync.discarded)
               for r in g.rollouts}
    common = [(g.pool_index, r) for g in (*res.groups, *res.abandoned, *res.discarded) for r in g.rollouts
              if (g.pool_index, r.seed) in by_seed]
    assert len(common) > 10 and all(by_seed[(p, r.seed)] == r.completion for p, r in common)


def test_completions_finish_out_of_order_and_closed_units_are_aborted_at_once():
    class AbandonOnZero(SequentialAllocator):
        name = "abandon_on_zero"

        def decide(self, units):
            return np.where(units.s == 0, Decision.ABANDON, Decision.CONTINUE)

    env = _env(32)
    alloc = AbandonOnZero(k=4, probe=(3,))
    res = collect(alloc, env, UniformSampler(300, seed=0), target_groups=6, seed=0, driver=STREAM)
    _check_accounting(res, env)
    ev = env.backend.events
    order = [t for e, t in ev if e == "finish"]
    assert order != sorted(order)  # per-seed lengths: later submissions finish first
    assert res.stats.abandoned_groups > 0 and any(g.size < 3 for g in res.abandoned)
    last_finish = max(i for i, (e, _) in enumerate(ev) if e == "finish")
    assert any(e == "abort" for e, _ in ev[:last_finish])  # aborted mid-step, not only at the end


def test_uniform_streams_exactly_the_target_groups():
    res, env = _stream("uniform", seed=3, target=6, slots=8)
    _check_accounting(res, env)
    s = res.stats
    assert s.stop_reason == "target_reached" and s.committed_groups == 6 and s.aborted_rollouts == 0
    assert s.rollouts == 24 and all(g.size == 4 for g in res.groups) and not res.discarded
    assert any(np.std([r.reward for r in g.rollouts]) == 0 for g in res.groups)  # saturated groups included
    assert s.mean_inflight > 4  # several groups in flight at once, refilled as they finish


def test_ds_streams_full_effective_groups_with_collects_seeds():
    res, env = _stream("ds", seed=5, target=8, slots=16)
    _check_accounting(res, env)
    s = res.stats
    assert s.stop_reason == "target_reached" and s.committed_groups >= 8
    assert all(g.size == 4 and np.std([r.reward for r in g.rollouts]) > 0 for g in res.groups)
    assert res.discarded and all(g.decision == Decision.DISCARD for g in res.discarded)
    saturated = [g for g in res.discarded if g.size == 4]
    assert saturated and all(np.std([r.reward for r in g.rollouts]) == 0 for g in saturated)
    ref = collect(make_allocator("ds", k=4), _env(backend=Plain()), UniformSampler(300, seed=5), target_groups=8,
                  seed=5)
    seeds = {r.seed: r.reward for g in (*ref.groups, *ref.discarded) for r in g.rollouts}
    mine = {r.seed: r.reward for g in (*res.groups, *res.discarded) for r in g.rollouts}
    shared = set(seeds) & set(mine)
    assert len(shared) >= 8 * 4 and all(seeds[x] == mine[x] for x in shared)  # same prompts, same rollout seeds


def test_ds_streaming_admission_options():
    res, env = _stream("ds:gen_batch_prompts=2", seed=1, target=6, slots=64)
    _check_accounting(res, env)
    assert res.stats.committed_groups >= 6 and res.stats.mean_inflight <= 2 * 4  # two groups in flight at most
    res, env = _stream("ds:max_gen_batches=1", seed=1, target=6, slots=64)
    _check_accounting(res, env)
    units = res.stats.committed_groups + len(res.discarded)
    assert units <= 6 and res.stats.stop_reason in ("allocator_done", "target_reached")


OWN = [n for n in ALLOCATORS.names() if ALLOCATORS.get(n).__module__.startswith("sara.")]


@pytest.mark.parametrize("barrier", [True, False], ids=["rounds", "stream"])
@pytest.mark.parametrize("name", OWN)
def test_every_registered_allocator_runs_under_both_modes(name, barrier):
    spec = {"ds": "ds:max_gen_batches=4"}.get(name, name)
    if barrier:
        env = _env(backend=Plain())
        res = collect(make_allocator(spec, k=4), env, UniformSampler(300, seed=4), target_groups=4, seed=4)
        assert res.stats.rollouts == sum(g.size for g in (*res.groups, *res.abandoned, *res.discarded))
    else:
        res, env = _stream(spec, seed=4, target=4)
        _check_accounting(res, env)
    assert res.stats.stop_reason in ("target_reached", "allocator_done") and res.stats.committed_groups >= 1


def test_budget_counts_started_rollouts():
    res, env = _stream("sara", target=50, max_rollouts=40, slots=8, fill_idle=True)
    _check_accounting(res, env)
    assert len(env.backend.submitted) <= 40 and res.stats.stop_reason == "max_rollouts"


def test_a_backend_that_cannot_stream_is_a_config_error():
    with pytest.raises(ConfigError, match="field 'barrier'"):
        collect(make_allocator("sara", k=4), _env(backend=Plain()), UniformSampler(300, seed=0), target_groups=2,
                driver=STREAM)
    with pytest.raises(ConfigError, match="field 'slots'"):
        collect(make_allocator("sara", k=4), _env(), UniformSampler(300, seed=0), target_groups=2,
                driver={**STREAM, "slots": 0})
    with pytest.raises(ConfigError, match="field 'carry_lag'.*streaming option"):
        collect(make_allocator("sara", k=4), _env(backend=Plain()), UniformSampler(300, seed=0), target_groups=2,
                driver={"carry_lag": 1})


def test_task_env_streams_exactly_when_its_backend_does():
    from sara.envs.base import StreamingEnv
    from sara.envs.task_env import StreamingTaskEnv
    from sara.envs.tree import TreeTaskEnv

    streaming, plain = _env(slots=5), _env(backend=Plain())
    assert type(streaming) is StreamingTaskEnv and isinstance(streaming, StreamingEnv) and streaming.slots == 5
    assert type(plain) is TaskEnv and not isinstance(plain, StreamingEnv) and not hasattr(plain, "submit")
    keyword = TaskEnv(TASK, backend=Arith(3), scorer_mode="inline")  # the backend given by keyword
    assert isinstance(keyword, StreamingTaskEnv)
    tree = TreeTaskEnv(TASK, Arith(3), scorer_mode="inline")  # a subclass is what it subclasses: rounds
    assert not isinstance(tree, StreamingEnv)


def test_scripted_streaming_backend_passes_check_backend():
    report = check_backend(Arith(3), state_dict={})
    assert report["streamed"] == 4


# ---- the tiny backend ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    torch = pytest.importorskip("torch")
    from sara.envs.tasks import make_task
    from sara.policies.tiny import make_tiny_policy

    torch.set_num_threads(1)
    task = make_task("sara/Arithmetic-v0:max_digits=1,pool_size=190,eval_size=8")
    policy = make_tiny_policy({"d_model": 32, "n_layers": 1, "n_heads": 2,
                               "warm_start": {"steps": 30, "batch_size": 32}}, prompts=task.prompts, cache=False)
    return task, policy


def test_tiny_backend_streams_the_completions_generate_returns(tiny):
    from sara.backends.tiny import TinyBackend
    from sara.envs.base import SamplingConfig

    _, policy = tiny
    backend = TinyBackend(policy, {"max_batch_size": 5})
    sampling = SamplingConfig(max_new_tokens=6, stop=("9",))
    reqs = [GenerationRequest(prompt=p, seeds=(s,)) for p in ("1+1=", "7-2=", "9+9=") for s in range(7)]
    ref = [o[0] for o in backend.generate(reqs, sampling)]
    backend.submit(list(enumerate(reqs[:9])), sampling)
    got, order = {}, []
    while backend.inflight():
        for tag, c in backend.poll():
            got[tag] = c
            order.append(tag)
            if tag == 2:  # late joiners enter the running batch
                backend.submit([(i, reqs[i]) for i in range(9, len(reqs))], sampling)
    assert sorted(got) == list(range(len(reqs)))
    for i, c in got.items():
        assert (c.token_ids, c.text, c.finish_reason, c.seed) == (ref[i].token_ids, ref[i].text,
                                                                  ref[i].finish_reason, ref[i].seed)
        assert np.allclose(c.logprobs, ref[i].logprobs, atol=1e-5)
    assert {c.num_tokens for c in ref} != {6}  # some stop early, so rows leave and join
    backend.submit([(99, reqs[0])], sampling)
    assert backend.abort([99, 12345]) == 0 and backend.inflight() == 0  # aborted before any tick: 0 tokens
    assert check_backend(backend, state_dict=policy.state_dict())["streamed"] == 4


def test_streaming_sara_costs_what_synchronous_sara_costs(tiny):
    # Behavioural, not timing: rollouts per effective group within a few % (both drivers use the same seeds).
    from sara.backends.tiny import TinyBackend

    task, policy = tiny
    env = TaskEnv(task, TinyBackend(policy, {"max_batch_size": 32}), scorer_mode="inline")
    cost = {}
    for name, driver in (("sync", None), ("stream", STREAM)):
        rollouts = effective = 0
        for s in range(6):
            res = collect(make_allocator("sara", k=4), env, UniformSampler(len(env.prompts), seed=s),
                          target_groups=16, seed=s, driver=driver)
            rollouts, effective = rollouts + res.stats.rollouts, effective + res.stats.effective_groups
        cost[name] = rollouts / effective
    assert cost["stream"] == pytest.approx(cost["sync"], rel=0.05), cost


def test_every_streamed_request_says_which_rollout_of_its_unit_it_is():
    """``RolloutRequest.index`` is the rollout's j: its seed is ``(seed, step, prompt, occurrence, j)``."""
    seen = []
    env = _env(16)
    real = env.submit

    def submit(items):
        seen.extend(req for _, req in items)
        real(items)

    env.submit = submit
    collect(make_allocator("sara:probe=2", k=4), env, UniformSampler(300, seed=2), target_groups=6, seed=2,
            driver=STREAM)
    assert seen and any(req.index > 0 for req in seen)
    for req in seen:
        assert req.seeds[0] == int(derive_seeds(2, 0, req.pool_index, 0, req.index))


class FailsOnPoll(Arith):
    """``Arith`` whose engine dies on its ``n``-th poll."""

    def __init__(self, n: int, slots: int = 16) -> None:
        super().__init__(slots)
        self.n = n

    def poll(self, timeout=None):
        self.n -= 1
        if self.n == 0:
            raise RuntimeError("engine died")
        return super().poll(timeout)


@pytest.mark.parametrize("with_carry", [False, True])
def test_a_step_that_fails_leaves_nothing_running_on_the_engine(with_carry):
    backend = FailsOnPoll(n=10**9, slots=32)
    env, alloc, sampler = _env(backend=backend), make_allocator("sara", k=4), UniformSampler(300, seed=0)
    carry = None
    if with_carry:
        carry = collect(alloc, env, sampler, target_groups=4, seed=0, step=0,
                        driver={**STREAM, "carry_lag": 1}).carry
        assert carry is not None and carry.live  # the failing step has running rollouts to adopt
    backend.n = 3
    with pytest.raises(RuntimeError, match="engine died"):
        collect(alloc, env, sampler, target_groups=50, seed=0, step=1, carry=carry,
                driver={**STREAM, "carry_lag": 1 if with_carry else 0})
    assert backend.inflight() == 0 and backend.aborted  # everything it had started (and adopted) is aborted


def test_a_step_told_not_to_hand_on_carries_nothing_whatever_its_lag():
    """``hand_on=False`` (the trainer's step before a checkpoint or the run's end): the same ``driver`` with
    ``carry_lag=1`` hands nothing on and leaves nothing running; with ``hand_on`` it carries its open units."""
    backend = FailsOnPoll(n=10**9, slots=32)
    env, alloc, sampler = _env(backend=backend), make_allocator("sara", k=4), UniformSampler(300, seed=0)
    driver = {**STREAM, "carry_lag": 1}
    handed = collect(alloc, env, sampler, target_groups=4, seed=0, step=0, driver=driver)
    assert handed.carry is not None and handed.carry.live
    last = collect(alloc, env, sampler, target_groups=4, seed=0, step=1, carry=handed.carry, driver=driver,
                   hand_on=False)
    assert last.carry is None and backend.inflight() == 0


def test_the_barrier_is_a_dispatch_policy():
    """``DriverConfig.barrier`` picks the loop's dispatch policy and nothing else in the loop branches on it: rounds
    admit whatever is idle and are cut to the budget, streaming never starts past it; its capacity is the driver's
    slots or the engine's."""
    import ast
    import inspect

    from sara.driver import DriverConfig, Rounds, Streaming, collect, dispatch_policy

    env = _env(slots=12)
    rounds, stream = dispatch_policy(DriverConfig(), env), dispatch_policy(DriverConfig(barrier=False), env)
    assert rounds == Rounds(1000) and stream == Streaming(12)
    assert dispatch_policy(DriverConfig(barrier=False, slots=5), env) == Streaming(5)
    assert (rounds.room(7, 3), stream.room(7, 3)) == (7, 3)  # a round admits regardless of the budget, then is cut
    assert (rounds.cut(3, 3), rounds.cut(2, 3), stream.cut(3, 3)) == (True, False, False)
    assert (rounds.halt(1000, 5, "spent"), rounds.halt(2, 0, "spent"), rounds.halt(2, 5, "spent")) == (
        "max_rounds", "spent", "")
    assert stream.halt(10**6, 0, "spent") == ""
    reads = [node for node in ast.walk(ast.parse(inspect.getsource(collect)))
             if isinstance(node, ast.Attribute) and node.attr == "barrier"]
    assert len(reads) == 2, "collect reads driver.barrier beyond refusing a carry and the in-flight mode"
