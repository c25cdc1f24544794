"""Multi-step allocation benchmark options: --pool-epochs / --drift / samplers / starvation fields."""

import numpy as np
import pytest

from sara.bench.allocation import AllocationBenchConfig, drift_rates, num_steps, run_allocation_bench
from sara.specs import split_specs


def test_drift_moves_trained_prompts_most():
    rng = np.random.default_rng(0)
    rates = np.full(2000, 0.3)
    trained = np.r_[np.ones(1000), np.zeros(1000)]
    new = drift_rates(rates, trained, 0.2, rng)
    assert new[:1000].mean() > new[1000:].mean() > 0.3
    assert ((new > 0) & (new < 1)).all()


def test_multi_step_report():
    cfg = AllocationBenchConfig(population="u-shaped", k=8, target_groups=16, seeds=1, pool_size=160, pool_epochs=1.0,
                                drift=0.1, sampler="predictive",
                                allocators=split_specs("sara_paper:prior=history,tau_low=0.2;sara@uniform"))
    assert num_steps(cfg) == 10
    report = run_allocation_bench(cfg)
    rows = {r["allocator"]: r for r in report["results"]}
    assert report["reference_added"] and set(rows) == {"sara_paper:prior=history,tau_low=0.2", "sara@uniform"}
    # Paired baseline: DS alone on the same pools and seeds (the reference samples uniformly in both runs).
    ds = run_allocation_bench(cfg.model_copy(update={"allocators": ("ds",)}))["results"][0]
    tau = {"sara_paper:prior=history,tau_low=0.2": 0.2, "sara@uniform": 0.45}
    for spec, r in rows.items():
        assert r["ratio_vs_ds"] == pytest.approx(r["rollouts_per_effective_group"] / ds["rollouts_per_effective_group"])
        assert r["ratio_vs_ds"] < 0.9 and r["waste_fraction"] < ds["waste_fraction"]  # SARA beats DS, paired
        assert 0.0 < r["wrong_abandon_rate"] <= tau[spec]  # the tau_low guarantee (plus a few abandons to show it)
        assert r["starvation_rate"] == 0.0  # one epoch over a 160-prompt pool draws every prompt
        assert r["effective_groups"] >= 10 * 16
    # The history prior with the predictive sampler spends fewer rollouts than plain SARA with uniform sampling.
    assert rows["sara_paper:prior=history,tau_low=0.2"]["ratio_vs_ds"] < rows["sara@uniform"]["ratio_vs_ds"]
    assert report["config"]["pool_epochs"] == 1.0 and report["config"]["drift"] == 0.1
