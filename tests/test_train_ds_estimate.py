"""The 'what DS would have spent' estimate of the trainer is unbiased under sequential stopping."""

import numpy as np
import pytest

from sara import SimulatedEnv, UniformSampler, collect, make_allocator
from sara.metrics import OutcomeCounts


@pytest.mark.parametrize("population", ["u-shaped", "mid-training", "uniform", "beta:0.3,2"])
def test_p_mixed_estimate_matches_truth(population):
    k = 8
    env = SimulatedEnv(population, size=20_000, seed=0)
    truth = float(np.mean(1 - env.rates**k - (1 - env.rates) ** k))
    outcomes = OutcomeCounts(k)
    sampler = UniformSampler(len(env.prompts), seed=0)
    alloc = make_allocator("sara_paper:tau_low=0.45", k=k)
    for step in range(4):
        res = collect(alloc, env, sampler, target_groups=256, seed=1, step=step)
        outcomes.record([*res.groups, *res.abandoned, *res.discarded])
    est = outcomes.p_mixed()
    # a Beta fit is exact for Beta populations and close for mixtures; the old uniform-prior credit was off by 0.1+
    assert est == pytest.approx(truth, abs=0.04)


def test_outcome_counts_round_trip_through_state_dict():
    env = SimulatedEnv("u-shaped", size=2_000, seed=0)
    res = collect(make_allocator("sara", k=8), env, UniformSampler(len(env.prompts), seed=0), target_groups=64)
    a = OutcomeCounts(8)
    a.record([*res.groups, *res.abandoned])
    b = OutcomeCounts(4)
    b.load_state_dict(a.state_dict())
    assert b.k == 8 and b.counts == a.counts and b.p_mixed() == a.p_mixed()
    assert sum(a.counts.values()) == len(res.groups) + len(res.abandoned)


def test_p_mixed_estimate_per_group_on_a_two_band_pool():
    # Half never solvable, half at p = 0.2, and an allocator that abandons the hard band after one failure: the
    # estimate fitted per band (the labels the allocator groups by) recovers P(mixed) from the truncated prefixes.
    from sara.build import build_allocation
    from sara.types import Prompt

    k, size = 8, 4_000
    rates = np.concatenate([np.zeros(size // 2), np.full(size // 2, 0.2)])
    labels = np.repeat([0, 1], size // 2)
    prompts = [Prompt(id=str(i), metadata={"band": int(b)}) for i, b in enumerate(labels)]
    env = SimulatedEnv(rates)
    alloc, sampler = build_allocation("sara:group_by=band", UniformSampler(size, seed=0), k=k, prompts=prompts)
    grouped, pooled = OutcomeCounts(k, labels=labels), OutcomeCounts(k)
    for step in range(4):
        res = collect(alloc, env, sampler, target_groups=128, seed=1, step=step)
        for counts in (grouped, pooled):
            counts.record([*res.groups, *res.abandoned, *res.discarded])
    truth = float(np.mean(1 - rates**k - (1 - rates) ** k))
    assert grouped.p_mixed() == pytest.approx(truth, abs=0.03)
    assert {key[0] for key in grouped.counts} == {0, 1}
    restored = OutcomeCounts(k)
    restored.load_state_dict({"k": k, "rows": [list(key[1:]) + [v] for key, v in pooled.counts.items()]})
    assert restored.p_mixed() == pooled.p_mixed()  # checkpoints from before groups load as one population


def _summary(**kw):
    from sara.train.summary import RunSummary

    base = dict(name="r", algo="grpo", allocator="sara", steps=2, acc_before=0.1, acc_after=0.2, greedy_before=None,
                greedy_after=None, rollouts=600, tokens=2400, effective_groups=50, committed_groups=50, p_mixed=0.4,
                ds_rollouts_estimate=1000.0, wall_seconds=1.0, out_dir="runs/r", ds_tokens_estimate=4000.0,
                tokens_by_fate={"committed": 2000, "abandoned": 300, "discarded": 100, "aborted": 0})
    return RunSummary(**{**base, **kw})


@pytest.mark.parametrize("sampler, applies", [("uniform", True), (" uniform ", True), ("predictive", False),
                                              ("predictive:decay=0.7", False)])
def test_the_estimate_applies_to_uniform_draws_only(sampler, applies):
    from sara.metrics import ds_estimate_applies
    from sara.samplers import make_sampler

    assert ds_estimate_applies(sampler) is applies
    assert ds_estimate_applies(make_sampler(sampler.strip(), 100, k=8)) is applies


def test_the_summary_shows_the_estimate_under_uniform_draws_and_says_why_not_otherwise():
    from sara.commands.train import format_summary, summary_report
    from sara.train import TrainConfig

    uniform = format_summary(_summary(), k=8)
    assert "| DS would have spent (est.: k / P(mixed) per effective group) | 1,000 |" in uniform.replace("  ", " ")
    assert "rollouts saved vs DS (est.)" in uniform
    predictive = format_summary(_summary(), k=8, sampler="predictive:decay=0.7")
    assert "rollouts saved vs DS" not in predictive and "1,000" not in predictive
    assert "n/a with the predictive sampler" in predictive and "--set allocator=ds" in predictive
    report = summary_report(_summary(), TrainConfig(sampler="predictive"), 1.0)
    assert report["ds_rollouts_estimate"] is None and report["ds_tokens_estimate"] is None
    assert summary_report(_summary(), TrainConfig(), 1.0)["ds_rollouts_estimate"] == 1000.0
