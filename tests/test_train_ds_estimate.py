"""The 'what DS would have spent' estimate of the trainer is unbiased under sequential stopping."""

import numpy as np
import pytest

from sara import SimulatedEnv, UniformSampler, collect, make_allocator
from sara.train import estimate_p_mixed, record_units


@pytest.mark.parametrize("population", ["u-shaped", "mid-training", "uniform", "beta:0.3,2"])
def test_p_mixed_estimate_matches_truth(population):
    k = 8
    env = SimulatedEnv(population, size=20_000, seed=0)
    truth = float(np.mean(1 - env.rates**k - (1 - env.rates) ** k))
    totals: dict[str, float] = {}
    sampler = UniformSampler(len(env.prompts), seed=0)
    alloc = make_allocator("sara:tau_low=0.45", k=k)
    for step in range(4):
        res = collect(alloc, env, sampler, target_groups=256, seed=1, step=step)
        record_units(totals, [*res.groups, *res.abandoned, *res.discarded], k)
    est = estimate_p_mixed(totals, k)
    # a Beta fit is exact for Beta populations and close for mixtures; the old uniform-prior credit was off by 0.1+
    assert est == pytest.approx(truth, abs=0.04)
