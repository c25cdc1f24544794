"""Multi-step allocation benchmark options (issue 5): --epochs / --drift / samplers / starvation fields."""

import numpy as np

from sara.bench.allocation import AllocationBenchConfig, drift_rates, num_steps, run_allocation_bench
from sara.commands.bench import split_specs


def test_drift_moves_trained_prompts_most():
    rng = np.random.default_rng(0)
    rates = np.full(2000, 0.3)
    trained = np.r_[np.ones(1000), np.zeros(1000)]
    new = drift_rates(rates, trained, 0.2, rng)
    assert new[:1000].mean() > new[1000:].mean() > 0.3
    assert ((new > 0) & (new < 1)).all()


def test_multi_step_report():
    cfg = AllocationBenchConfig(population="u-shaped", k=8, target_groups=16, seeds=1, pool_size=160, epochs=1.0,
                                drift=0.1, sampler="predictive",
                                allocators=split_specs("sara:prior=history,tau_low=0.2;sara@uniform"))
    assert num_steps(cfg) == 10
    report = run_allocation_bench(cfg)
    rows = {r["allocator"]: r for r in report["results"]}
    assert report["reference_added"] and set(rows) == {"sara:prior=history,tau_low=0.2", "sara@uniform"}
    for r in rows.values():
        for key in ("ratio_vs_ds", "wrong_abandon_rate", "waste_fraction", "starvation_rate", "never_revisited_rate"):
            assert 0.0 <= r[key] <= 2.0
        assert r["effective_groups"] >= 10 * 16
    assert report["config"]["epochs"] == 1.0 and report["config"]["drift"] == 0.1
