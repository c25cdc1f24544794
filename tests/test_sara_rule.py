"""SARA's default (cost-optimal) stopping rule, the paper rule's explicit options, and sara + predictive composition."""

import numpy as np
import pytest

from sara.allocators import Decision, SARAAllocator, SARAPaperAllocator, SequentialAllocator, make_allocator
from sara.allocators.optimal import optimal_tables, rule_figures, rule_tables, solve_rho
from sara.build import build_allocation
from sara.config import ConfigError
from sara.driver import collect
from sara.envs.sim.binary import SimulatedEnv
from sara.priors import BorrowedHistory, EmpiricalBayesPrior, HistoryPrior
from sara.priors.grid import GridPrior, beta_on_grid
from sara.priors.history import START_DECAY
from sara.samplers import make_sampler


def _first_stop_rule(k, nf, ns):
    a, b = np.arange(k + 1) >= nf, np.arange(k + 1) >= ns
    a[[0, k]] = b[[0, k]] = False
    return a, b


def test_a_name_is_one_rule_whatever_its_options():
    a = make_allocator("sara", k=8)
    assert (type(a), a.prior_kind, type(a.prior)) == (SARAAllocator, "empirical", GridPrior)
    for spec in ("sara_paper:tau_low=0.45", "sara_paper", "sara_paper:prior=constant,tau_low=0.45"):
        p = make_allocator(spec, k=8)
        assert (type(p), p.prior_kind, p.config.tau_low) == (SARAPaperAllocator, "constant", 0.45)
    h = make_allocator("sara:prior=history", k=8)
    assert type(h) is SARAAllocator and isinstance(h.prior, HistoryPrior) and isinstance(h.prior.base, GridPrior)
    assert isinstance(make_allocator("sara_tree", k=8), SARAPaperAllocator)  # its own p_eff: the threshold rule
    # An option of the other rule is rejected with the spec to use instead; 'rule=' is no option at all.
    with pytest.raises(ConfigError, match=r"field 'tau_low': an option of 'sara_paper'.*use 'sara_paper:tau_low=0.3'"):
        make_allocator("sara:tau_low=0.3", k=8)
    with pytest.raises(ConfigError, match=r"field 'group_by': an option of 'sara'.*use 'sara:group_by=level'"):
        make_allocator("sara_paper:group_by=level", k=8)
    for spec in ("sara:rule=paper", "sara_paper:rule=optimal"):
        with pytest.raises(ConfigError, match="field 'rule': the name is the rule"):
            make_allocator(spec, k=8)


def test_uniform_prior_never_abandons_at_k8():
    """Beta(1, 1): rho = DS = k / P(mixed) = 8 / (7/9) = 72/7. At 7 identical outcomes one more rollout mixes with
    P = 1/9 and then nothing is left to fill: continue iff 1 - rho / 9 < 0, i.e. rho > 9, true; so never abandon."""
    g = GridPrior().grid
    rho, ab_f, ab_s = solve_rho(beta_on_grid(1.0, 1.0, g), g, 8)
    assert rho == pytest.approx(72 / 7, rel=2e-3) and not ab_f.any() and not ab_s.any()
    # The 7-prefix's last rollout is worth it exactly when rho > 9.
    w = beta_on_grid(1.0, 1.0, g)[None]
    assert optimal_tables(w, g, 8, 8.9)[0][0, 7] and not optimal_tables(w, g, 8, 9.1)[0][0, 7]


def test_two_point_population_hand_computed():
    """60% of prompts always solved, 40% at p = 1/2, k = 4. Abandon after the first success, never after failures:
    cost = .6 * 1 + .4 * (.5 * 1 + .5 * 4) = 1.6, effective = .4 * .5 * 7/8 = .175, ratio 64/7 (DS: 4 / .35 = 80/7)."""
    grid, w = np.array([0.5, 1.0]), np.array([0.4, 0.6])
    rho, ab_f, ab_s = solve_rho(w, grid, 4)
    assert ab_f.tolist() == [False] * 5 and ab_s.tolist() == [False, True, True, True, False]
    assert rho == pytest.approx(64 / 7)
    fig = rule_figures(ab_f, ab_s, grid, 4, w)
    assert fig["ds_rollouts_per_effective_group"] == pytest.approx(80 / 7)
    assert fig["wrong_abandons"] == pytest.approx(0.4 * 0.5 * 7 / 8)


@pytest.mark.parametrize("a,b", [(0.15, 0.15), (3.0, 0.4), (0.4, 2.5)])
def test_dp_rule_is_the_best_first_stop_rule(a, b):
    """Brute force over every (abandon-after-n-failures, abandon-after-n-successes) pair: none beats the DP."""
    g, k = GridPrior().grid, 6
    w = beta_on_grid(a, b, g)
    rho, ab_f, ab_s = solve_rho(w, g, k)
    best = min(rule_figures(*_first_stop_rule(k, nf, ns), g, k, w)["rollouts_per_effective_group"]
               for nf in range(1, k + 1) for ns in range(1, k + 1))
    assert rule_figures(ab_f, ab_s, g, k, w)["rollouts_per_effective_group"] == pytest.approx(best, rel=1e-9)
    assert rho == pytest.approx(best, rel=1e-9)


def test_rule_figures_match_a_simulation():
    rng = np.random.default_rng(0)
    k, p = 8, rng.beta(0.5, 0.5, 40_000)
    ab_f, ab_s = _first_stop_rule(k, 3, 5)
    exact = rule_figures(ab_f, ab_s, p, k)
    r = rng.random((len(p), k)) < p[:, None]
    cost = eff = 0
    for row in r:
        for n in range(1, k + 1):
            if row[:n].any() and not row[:n].all():
                cost, eff = cost + k, eff + 1
                break
            if n == k or (ab_f if not row[0] else ab_s)[n]:
                cost += n
                break
    assert cost / eff == pytest.approx(exact["rollouts_per_effective_group"], rel=0.02)


POPULATIONS = {"u-shaped": ("beta", 0.15, 0.15), "mostly mixed": ("beta", 2.0, 2.0), "uniform": ("beta", 1.0, 1.0),
               "near 1": ("beta", 3.0, 0.4), "saturated + mixed": ("mix", 0.6, 2.0)}


def _population(name, rng, m):
    kind, x, y = POPULATIONS[name]
    if kind == "beta":
        return rng.beta(x, y, m)
    return np.where(rng.random(m) < x, 1.0, rng.beta(y, y, m))


@pytest.mark.parametrize("name", list(POPULATIONS))
def test_fitted_rule_never_worse_than_ds(name):
    """The rule the online prior converges to (EM on 3000 complete groups of the population, fixed seed), evaluated
    exactly on the population: never more rollouts per effective group than DS, and strictly fewer where DS saturates."""
    rng, k = np.random.default_rng(7), 8
    p = _population(name, rng, 3000)
    prior = GridPrior()
    prior.update(np.arange(3000), np.full(3000, k), rng.binomial(k, p).astype(float), step=0)
    _, ab_f, ab_s = rule_tables(prior, k)
    fig = rule_figures(ab_f[0], ab_s[0], p, k)
    assert fig["ratio_vs_ds"] <= 1.0 + 1e-9
    paper = rule_figures(*_first_stop_rule(k, 4, 4), p, k)
    assert fig["ratio_vs_ds"] <= paper["ratio_vs_ds"] + 0.01
    if name in ("u-shaped", "near 1", "saturated + mixed"):
        assert fig["ratio_vs_ds"] < 0.9


@pytest.mark.parametrize("population", ["beta:2,2", "beta:3,0.4"])
def test_default_sara_not_worse_than_ds_in_collect(population):
    """End to end through collect (admission, rounds, units in flight at the step's end) on the simulator, same
    pools and rollout seeds: default SARA within 2% of DS where DS is optimal, well below it near saturation."""
    out = {}
    for spec in ("ds", "sara"):
        rollouts = eff = 0
        for seed in range(2):
            env = SimulatedEnv(population, size=8000, seed=seed)
            alloc, sampler = build_allocation(spec, "uniform", k=8, pool_size=8000, seed=seed)
            for t in range(2):
                st = collect(alloc, env, sampler, target_groups=128, seed=seed, step=t).stats
                rollouts, eff = rollouts + st.rollouts, eff + st.effective_groups
        out[spec] = rollouts / eff
    ratio = out["sara"] / out["ds"]
    assert ratio < (1.02 if population == "beta:2,2" else 0.9)


def test_history_decides_per_prompt():
    """A prompt solved 16/16 before is abandoned after one success; a fresh prompt in a mostly-mixed population is not."""
    alloc = make_allocator("sara:prior=history,decay=1,audit=0", k=8, oversample=1)
    prior = alloc.prior
    prior.base.update(np.arange(400), np.full(400, 8), np.random.default_rng(0).binomial(8, 0.5, 400).astype(float), 0)
    prior.update(np.array([0]), np.array([16]), np.array([16.0]), step=0)
    alloc.begin_step(2, step=1)
    ids = alloc.admit(np.array([0, 1]))
    closed, dec = alloc.observe(ids, np.ones(2))
    assert closed.tolist() == [ids[0]] and dec.tolist() == [Decision.ABANDON]


def test_the_builder_gives_the_predictive_history():
    sampler = make_sampler("predictive", 500, seed=0, k=8)
    alloc, same = build_allocation("sara", sampler, k=8)
    assert same is sampler and isinstance(alloc.prior, BorrowedHistory) and alloc.prior.history is sampler.posterior
    assert alloc.prior_kind == "history" and isinstance(alloc.prior.base, GridPrior)
    paper, _ = build_allocation("sara_paper", "predictive", k=8, pool_size=500)
    assert isinstance(paper.prior, BorrowedHistory) and isinstance(paper.prior.base, EmpiricalBayesPrior)
    for spec, kind in (("sara:prior=constant", GridPrior), ("sara:prior=empirical", GridPrior), ("ds", None)):
        after, _ = build_allocation(spec, "predictive", k=8, pool_size=500)  # the spec set the prior / has none
        assert (type(after.prior) is kind) if kind else not isinstance(after, SequentialAllocator)
    with pytest.raises(ConfigError, match="field 'prior'"):  # a history given to a rule whose spec set its prior
        SARAAllocator({"k": 8, "prior": "constant"}, history=sampler.posterior)
    plain, _ = build_allocation("sara", "uniform", k=8, pool_size=500)
    assert isinstance(plain.prior, GridPrior)
    # Evidence the sampler gathered is what the allocator's units start from.
    sampler.update(np.array([3]), np.array([8]), np.array([8.0]), step=0)
    prm = alloc.prior.params(np.array([3, 4]))
    assert prm["hist_s"].tolist() == pytest.approx([8 * START_DECAY, 0.0]) and prm["hist_f"].tolist() == [0.0, 0.0]


def test_sara_at_predictive_in_the_benchmark_reads_the_history(monkeypatch):
    from sara.bench import allocation

    seen = []
    real = allocation.build_allocation

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(type(out[0].prior).__name__ if isinstance(out[0], SequentialAllocator) else None)
        return out

    monkeypatch.setattr(allocation, "build_allocation", spy)
    cfg = allocation.AllocationBenchConfig(population="u-shaped", target_groups=16, seeds=1, pool_size=400,
                                           allocators=("sara@predictive", "sara:prior=empirical@predictive"))
    allocation.run_allocation_bench(cfg)
    assert seen == [None, "BorrowedHistory", "GridPrior"]  # ds (reference), then the two specs


def test_audited_units_are_never_abandoned():
    """With audit=0.5 about half the prompts of a step (hash of step and prompt) are never abandoned; audit=0 none."""
    def abandoned(spec):
        alloc = make_allocator(spec, k=8, oversample=1)
        alloc.prior.update(np.arange(400), np.full(400, 8), np.zeros(400), 0)  # a population that never succeeds
        alloc.begin_step(1000, step=1)
        ids = alloc.admit(np.arange(1000))
        closed, dec = alloc.observe(ids, np.zeros(1000))
        return int((dec == Decision.ABANDON).sum())

    assert abandoned("sara:audit=0") == 1000
    assert 440 < abandoned("sara:audit=0.5") < 560
    assert abandoned("sara:audit=0.5,audit_seed=1") != abandoned("sara:audit=0.5")
