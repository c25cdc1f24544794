"""Empirical-Bayes and history priors (issue 5): fits, decay, wiring into SARA's p_eff."""

import numpy as np
import pytest

from sara import SimulatedEnv, UniformSampler, collect
from sara.allocators import Decision, make_allocator
from sara.config import ConfigError
from sara.priors import EmpiricalBayesPrior, HistoryPrior, make_prior
from sara.testing import check_allocator


def _truncated_data(a, b, size, k, n_same, rng):
    """Outcomes under 'abandon after n_same identical, else fill to k' (optional stopping)."""
    p = rng.beta(a, b, size)
    x = rng.random((size, k)) < p[:, None]
    first_diff = np.argmax(x != x[:, :1], axis=1)
    mixed_early = (x != x[:, :1]).any(axis=1) & (first_diff < n_same)
    n = np.where(mixed_early, k, np.where((x != x[:, :1]).any(axis=1), n_same, n_same))
    s = np.array([row[:m].sum() for row, m in zip(x, n)])
    return n, s


def test_marginal_likelihood_fit_is_consistent_under_optional_stopping():
    rng = np.random.default_rng(0)
    n, s = _truncated_data(0.15, 0.15, 6000, 8, 3, rng)
    prior = EmpiricalBayesPrior(min_units=10)
    prior.update(np.arange(len(n)), n, s, step=0)
    assert prior.alpha0 == pytest.approx(0.15, rel=0.2)
    assert prior.beta0 == pytest.approx(0.15, rel=0.2)


def test_empirical_prior_refits_within_the_first_step():
    env = SimulatedEnv("u-shaped", size=4000, seed=1)
    alloc = make_allocator("sara_paper:prior=empirical,tau_low=0.12", k=8)
    collect(alloc, env, UniformSampler(4000, seed=1), target_groups=96, seed=1, step=0)
    # Fitted online (the true population is Beta(0.15, 0.15)); the step's units were rewritten in place.
    assert 0.07 < alloc.prior.alpha0 < 0.3 and 0.07 < alloc.prior.beta0 < 0.3
    assert np.allclose(alloc.units.prior["alpha0"], alloc.units.prior["alpha0"][0])


def test_empirical_sara_matches_true_prior_sara_on_one_step():
    def run(spec):
        env = SimulatedEnv("u-shaped", size=8000, seed=2)
        return collect(make_allocator(spec, k=8), env, UniformSampler(8000, seed=2), target_groups=192, seed=2).stats

    eb = run("sara_paper:prior=empirical,tau_low=0.12")
    true = run("sara_paper:tau_low=0.12,alpha0=0.15,beta0=0.15")
    ratio = (eb.rollouts / eb.effective_groups) / (true.rollouts / true.effective_groups)
    assert abs(ratio - 1.0) < 0.02


def test_history_prior_abandons_an_all_fail_prompt_after_one_rollout():
    alloc = make_allocator("sara_paper:prior=history,decay=0.9,tau_low=0.2", k=8)
    # Step 0: population data (so the base is fitted) + prompt 7 failed 8/8.
    rng = np.random.default_rng(3)
    n, s = _truncated_data(0.3, 0.3, 400, 8, 8, rng)
    n[7], s[7] = 8, 0
    alloc.prior.update(np.arange(400), n, s, step=0)
    alloc.begin_step(4, step=1)
    alloc.admit(np.array([7, 9999]))  # 9999: never seen
    closed, dec = alloc.observe(np.array([0, 1]), np.array([0.0, 0.0]))
    assert closed.tolist() == [0] and dec.tolist() == [Decision.ABANDON]


def test_history_evidence_decays_per_step():
    prior = HistoryPrior(decay=0.5, base=make_prior("constant"))
    prior.update(np.array([3]), np.array([8]), np.array([6.0]), step=0)
    for dt, w in ((0, 1.0), (1, 0.5), (3, 0.125)):
        s, f = prior.evidence(np.array([3]), step=dt)
        assert s[0] == pytest.approx(6 * w) and f[0] == pytest.approx(2 * w)
    params = prior.params(np.array([3, 4]))
    # Used in step 1: the evidence of step 0 counts lambda^1.
    assert params["alpha0"].tolist() == pytest.approx([4.0, 1.0]) and params["beta0"].tolist() == pytest.approx([2.0, 1.0])


def test_history_update_with_units_that_delivered_nothing_reaches_the_base_whole():
    # Streaming steps close units with no delivered rollout (aborted, or carried on: n = 0 in observations).
    seen = []

    class Recording(type(make_prior("constant"))):
        def update(self, pool_index, n, rsum, step):
            seen.append((len(pool_index), len(n), len(rsum)))

    prior = HistoryPrior(decay=1.0, base=Recording())
    prior.update(np.array([3, 4, 5]), np.array([0, 4, 2]), np.array([0.0, 3.0, 1.0]), step=0)
    assert seen == [(3, 3, 3)]
    s, f = prior.evidence(np.array([3, 4, 5]))
    assert s.tolist() == [0.0, 3.0, 1.0] and f.tolist() == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("spec", ["sara:prior=empirical", "sara_paper:prior=history,decay=0.8,tau_low=0.2"])
def test_learned_prior_specs_conform(spec):
    check_allocator(make_allocator(spec, k=8), target_groups=16, steps=2, seeds=(0,))


def test_prior_option_is_validated():
    with pytest.raises(Exception, match="prior"):
        make_allocator("sara:prior=oracle")
    with pytest.raises(Exception, match="decay"):
        make_allocator("sara:prior=history,decay=0")


def test_prior_errors_are_config_errors_naming_the_field():
    from sara.config import ConfigError

    with pytest.raises(ConfigError, match="field 'prior'"):
        make_prior("bogus")
    with pytest.raises(ConfigError, match="field 'decay'"):
        HistoryPrior(decay=0.0)
    with pytest.raises(ConfigError, match="field 'window'"):
        EmpiricalBayesPrior(window=0)


def _revisits(prior, rng, p_next, steps=40, size=200, every=5):
    """Feed ``prior`` a pool visited in turn (every prompt each ``every`` steps, 8 rollouts per visit); ``p_next(p)``
    gives a prompt's success rate at its next visit."""
    p = rng.beta(0.3, 0.3, size)
    for t in range(steps):
        idx = np.arange(t % every, size, every)
        p[idx] = p_next(p[idx])
        s = rng.binomial(8, p[idx]).astype(float)
        prior.update(idx, np.full(len(idx), 8), s, step=t)


def test_auto_decay_keeps_history_that_predicts_and_drops_history_that_does_not():
    from sara.priors.history import AUTO_DECAYS, START_DECAY

    rng = np.random.default_rng(0)
    assert HistoryPrior().decay == START_DECAY and len(HistoryPrior().decays) == len(AUTO_DECAYS)  # auto by default
    stable = HistoryPrior("auto")
    _revisits(stable, rng, lambda p: p)  # success rates that do not move: a long memory predicts
    assert stable.decay >= 0.95
    moving = HistoryPrior("auto")
    _revisits(moving, rng, lambda p: rng.beta(0.3, 0.3, len(p)))  # a new rate at every visit: history misleads
    assert moving.decay == min(AUTO_DECAYS)
    fixed = HistoryPrior(0.7)
    _revisits(fixed, rng, lambda p: p)
    assert fixed.decay == 0.7 and fixed.decays.tolist() == [0.7]


def test_auto_decay_state_round_trips_and_checks_its_candidates():
    rng = np.random.default_rng(1)
    prior = HistoryPrior("auto")
    _revisits(prior, rng, lambda p: p, steps=20)
    again = HistoryPrior("auto")
    again.load_state_dict(prior.state_dict())
    idx = np.arange(200)
    assert again.decay == prior.decay and np.allclose(again.scores, prior.scores)
    assert np.allclose(again.params(idx)["alpha0"], prior.params(idx)["alpha0"])
    with pytest.raises(ValueError, match="decays"):
        HistoryPrior(0.7).load_state_dict(prior.state_dict())


@pytest.mark.parametrize("value", [0.0, 1.5, "fast"])
def test_decay_is_a_number_in_the_unit_interval_or_auto(value):
    with pytest.raises(ConfigError, match="decay"):
        make_allocator(f"sara:prior=history,decay={value}", k=8)
