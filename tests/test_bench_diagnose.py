"""sara.bench.diagnose: the per-step rollout breakdown, wrong abandons by finishing groups, population figures."""

import numpy as np
import pytest

from sara.allocators import make_allocator
from sara.bench.diagnose import AllocationDiagnostics, population_figures, summarize
from sara.driver import collect
from sara.envs.sim.binary import SimulatedEnv
from sara.samplers import make_sampler
from sara.step import WrongAbandons


class _NoCounterfactual:
    """The simulator seen as a real environment: rollouts only (wrong abandons must be found by finishing groups)."""

    def __init__(self, env):
        self.env, self.prompts = env, env.prompts

    def rollout(self, requests):
        return self.env.rollout(requests)


@pytest.mark.parametrize("spec", ["sara_paper:tau_low=0.45", "sara", "ds"])
def test_breakdown_matches_collect_accounting(spec):
    env = SimulatedEnv("u-shaped", size=4000, seed=2)
    sim_obs, real_obs = AllocationDiagnostics(env), AllocationDiagnostics(_NoCounterfactual(env), finish=True)
    alloc, sampler = make_allocator(spec, k=8), make_sampler("uniform", 4000, seed=2)
    stats = [collect(alloc, env, sampler, target_groups=64, seed=2, step=t,
                     observers=[sim_obs, real_obs, WrongAbandons(env)]).stats for t in range(2)]
    s = summarize(sim_obs.records)
    assert s["rollouts"] == sum(st.rollouts for st in stats)
    assert s["effective_groups"] == sum(st.effective_groups for st in stats)
    assert sum(s[f"share_{k}_rollouts"] for k in ("committed", "abandoned", "saturated", "in_flight")) == pytest.approx(1)
    assert s["share_abandoned_rollouts"] == pytest.approx(sum(st.abandoned_rollouts for st in stats) / s["rollouts"])
    wrong = sum(st.wrong_abandons for st in stats)
    # Finishing the abandoned groups with collect's seeds finds exactly the simulator's counterfactual.
    assert [r["wrong_abandons"] for r in real_obs.records] == [r["wrong_abandons"] for r in sim_obs.records]
    assert sum(r["wrong_abandons"] for r in sim_obs.records) == wrong
    if spec == "ds":
        assert s["share_abandoned_rollouts"] == 0 and s["share_saturated_rollouts"] > 0.5
    else:
        assert wrong > 0 and 0 < s["wrong_abandon_rate"] < 0.5
    assert sum(v for k, v in s.items() if k.startswith("q_")) == pytest.approx(1)


def test_population_figures_two_point():
    """60% of prompts never solved, 40% at 1/2, k = 4: DS = 4 / (0.4 * 7/8); the optimal rule abandons after one
    failure: cost 0.6 * 1 + 0.4 * (0.5 * 1 + 0.5 * 4) = 1.6, effective 0.4 * 0.5 * 7/8 = 0.175 (0.8x DS; the paper
    rule, after 3 identical outcomes at k = 4, costs 1.05x DS here)."""
    rates = np.r_[np.zeros(60), np.full(40, 0.5)]
    fig = population_figures(rates, 4)
    assert fig["ds"]["rollouts_per_effective_group"] == pytest.approx(4 / (0.4 * 7 / 8))
    assert fig["optimal"]["abandon_fail_at"] == 1
    assert fig["optimal"]["rollouts_per_effective_group"] == pytest.approx(1.6 / 0.175)
    assert fig["optimal"]["ratio_vs_ds"] == pytest.approx(0.8) and fig["paper"]["ratio_vs_ds"] == pytest.approx(1.05)
