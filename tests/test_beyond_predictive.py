"""Predictive prompt sampler (issue 5): selection by predicted mixed-group probability, exploration, state."""

import numpy as np
import pytest

from sara import SimulatedEnv, collect
from sara.allocators import make_allocator
from sara.config import ConfigError
from sara.samplers import make_sampler
from sara.samplers.predictive import PredictiveSampler


def _teach(sampler, mixed, fail):
    """One step of history: `mixed` prompts went 4/8, `fail` prompts 0/8."""
    idx = np.concatenate([mixed, fail])
    n = np.full(len(idx), 8)
    s = np.concatenate([np.full(len(mixed), 4.0), np.zeros(len(fail))])
    sampler.update(idx, n, s, step=0)


def test_prefers_prompts_with_mixed_history():
    sampler = PredictiveSampler(400, seed=0, explore=0.0)
    _teach(sampler, np.arange(0, 100), np.arange(100, 400))
    picked = sampler.sample(50)
    assert len(set(picked.tolist())) == 50
    assert np.mean(picked < 100) > 0.9


def test_no_duplicates_within_a_step_and_pool_exhaustion():
    sampler = make_sampler("predictive", 30, seed=1)
    a, b = sampler.sample(20), sampler.sample(20)
    assert len(a) == 20 and len(b) == 10 and not set(a.tolist()) & set(b.tolist())
    sampler.update(np.concatenate([a, b]), np.ones(30), np.zeros(30), step=0)
    assert len(sampler.sample(30)) == 30  # a new step: the whole pool is available again


def test_deterministic_and_restorable():
    s1, s2 = PredictiveSampler(500, seed=3), PredictiveSampler(500, seed=3)
    _teach(s1, np.arange(50), np.arange(50, 300))
    _teach(s2, np.arange(50), np.arange(50, 300))
    assert s1.sample(40).tolist() == s2.sample(40).tolist()
    state = s1.state_dict()
    s3 = PredictiveSampler(500, seed=99)
    s3.load_state_dict(state)
    assert s1.sample(40).tolist() == s3.sample(40).tolist()


def test_decay_and_thompson_keep_every_prompt_revisitable():
    # All-fail prompts are skipped at first but come back as their evidence ages (here 20 picks per step from 40
    # known-good prompts, so a bad prompt competes with good ones every step and still gets retried).
    sampler = PredictiveSampler(200, seed=4, decay=0.7, explore=0.0)
    _teach(sampler, np.arange(0, 40), np.arange(40, 200))
    seen = np.zeros(200, int)
    for step in range(1, 40):
        picked = sampler.sample(20)
        seen[picked] += 1
        sampler.update(picked, np.full(len(picked), 8), np.where(picked < 40, 4.0, 0.0), step=step)
    assert (seen[40:] > 0).mean() > 0.6
    assert seen[:40].mean() > 3 * seen[40:].mean()


def test_composes_with_an_allocator_over_steps():
    env = SimulatedEnv("u-shaped", size=1500, seed=5)
    sampler = make_sampler("predictive:decay=0.9", 1500, seed=5)
    alloc = make_allocator("sara_paper:prior=history,decay=0.9,tau_low=0.2", k=8)
    ratios = []
    for t in range(6):
        res = collect(alloc, env, sampler, target_groups=48, seed=5, step=t)
        assert res.stats.stop_reason == "target_reached"
        ratios.append(res.stats.rollouts / res.stats.effective_groups)
    assert np.mean(ratios[3:]) < 0.8 * ratios[0]  # history makes later steps cheaper


def test_options_are_validated():
    with pytest.raises(ConfigError, match="candidate_ratio"):
        make_sampler("predictive:candidate_ratio=0.5", 10)


def test_a_longer_memory_pays_on_a_revisited_pool_that_does_not_move():
    # A step draws about a tenth of this pool, so a prompt comes back about every ten steps. At decay=0.7 a visit's
    # evidence is nearly gone by then (0.7^10 = 3%); with decay=0.95 most of it is left, and on a pool whose success
    # rates do not move that buys cheaper effective groups (on a fast-learning LLM it does not: beyond.md 3).
    from sara.build import build_allocation

    assert PredictiveSampler(10, seed=0).config.decay == "auto"
    sampler = PredictiveSampler(10, seed=0, decay=0.95)
    sampler.update(np.array([0]), np.array([8]), np.array([0.0]), step=0)
    assert sampler.posterior.evidence(np.array([0]), step=10)[1][0] > 0.5 * 8 > 8 * 0.7**10

    def rollouts_per_effective_group(spec):
        env = SimulatedEnv("u-shaped", size=1000, seed=6)
        alloc, smp = build_allocation("sara", spec, k=8, pool_size=1000, seed=6)
        spent = effective = 0
        for t in range(24):
            res = collect(alloc, env, smp, target_groups=32, seed=6, step=t)
            if t >= 8:  # once every prompt has been drawn about once
                spent, effective = spent + res.stats.rollouts, effective + res.stats.effective_groups
        return spent / effective

    short = rollouts_per_effective_group("predictive:decay=0.7")
    assert rollouts_per_effective_group("predictive:decay=0.95") < 0.9 * short
    # The default (decay=auto) finds the long memory from the revisits alone (it starts at 0.7).
    assert rollouts_per_effective_group("predictive") < 0.9 * short
