"""Continuous rewards (issue 5): closed forms, the already-effective bound, simulator, allocator."""

import numpy as np
import pytest
from scipy.special import betaln

from sara import UniformSampler, collect
from sara.allocators import make_allocator
from sara.allocators.continuous import ContinuousEffectiveness
from sara.envs.sim.continuous import continuous_reward_fn, make_continuous_env
from sara.testing import check_allocator
from sara.units import UnitTable


def _table(rows):
    t = UnitTable()
    ids = t.add(np.arange(len(rows)))
    for i, r in zip(ids, rows):
        if len(r):
            t.update(np.full(len(r), i), np.asarray(r, float))
    return t


def test_boundary_atoms_use_the_beta_binomial_closed_form():
    m = ContinuousEffectiveness(k=8, eps=1e-6, a_low=0.3, a_high=0.2, a_mid=0.5)
    t = _table([[0.0] * 3, [1.0] * 2])
    got = m.p_effective(t, np.arange(2), 8)
    p_low = np.exp(betaln(0.3 + 8, 0.7) - betaln(0.3 + 3, 0.7))
    p_high = np.exp(betaln(0.2 + 8, 0.8) - betaln(0.2 + 2, 0.8))
    assert got.tolist() == pytest.approx([1 - p_low, 1 - p_high])


def test_all_low_prefix_matches_monte_carlo_of_the_model():
    rng = np.random.default_rng(0)
    a = np.array([0.3, 0.2, 0.5])
    q = rng.dirichlet(a, 200_000)
    cat = np.stack([rng.choice(3, p=row, size=8) for row in q[:20_000]])  # categories of 8 rollouts
    prefix_low = (cat[:, :3] == 0).all(axis=1)
    mc = 1 - (cat[prefix_low] == 0).all(axis=1).mean()
    m = ContinuousEffectiveness(k=8, eps=1e-6, a_low=0.3, a_high=0.2, a_mid=0.5)
    assert float(m.p_effective(_table([[0.0] * 3]), np.arange(1), 8)[0]) == pytest.approx(mc, abs=0.03)


def test_identical_interior_rewards_lower_p_eff_and_spread_raises_it():
    m = ContinuousEffectiveness(k=8, eps=0.05, sigma_scale=0.01)
    t = _table([[0.5], [0.5] * 2, [0.5] * 4, [0.5, 0.51]])
    p = m.p_effective(t, np.arange(4), 8)
    assert p[0] > p[1] > p[2]
    assert p[3] > p[1]


def test_already_effective_bound_is_tight_and_safe():
    rng = np.random.default_rng(1)
    k, eps = 8, 0.01
    m = ContinuousEffectiveness(k=k, eps=eps)
    for _ in range(200):
        n = rng.integers(2, k)
        prefix = rng.uniform(0.4, 0.4 + 0.1 * rng.random(), n)
        t = _table([prefix])
        if m.is_mixed(t, np.arange(1), eps)[0]:
            # Worst completion: everything else at the prefix midpoint. Still std > eps.
            mid = (prefix.min() + prefix.max()) / 2
            worst = np.concatenate([[prefix.min(), prefix.max()], np.full(k - 2, mid)])
            assert worst.std() > eps


def test_simulator_rewards_are_bounded_deterministic_and_pile_on_atoms():
    fn = continuous_reward_fn(noise=0.25, spread=0.5)
    u = np.random.default_rng(2).random(10_000)
    hard, mid = fn(np.zeros_like(u), u, u), fn(np.full_like(u, 0.5), u, u)
    assert hard.min() >= 0 and mid.max() <= 1
    assert (hard == 0).mean() > 0.95 and ((mid > 0) & (mid < 1)).mean() > 0.9
    env = make_continuous_env("u-shaped", size=100, seed=3)
    seeds = np.arange(50, dtype=np.uint64)
    assert env.rewards(np.arange(50) % 100, seeds).tolist() == env.rewards(np.arange(50) % 100, seeds).tolist()


def test_sara_continuous_conforms_on_continuous_and_binary_rewards():
    check_allocator(make_allocator("sara_continuous", k=8), target_groups=16, steps=2, seeds=(0,),
                    env_factory=lambda s: make_continuous_env("u-shaped", size=3000, seed=s))
    check_allocator(make_allocator("sara_continuous:low=-1,high=1", k=8), target_groups=16, steps=2, seeds=(1,))


def test_sara_continuous_saves_rollouts_over_ds_on_continuous_rewards():
    def cost(spec):
        env = make_continuous_env("u-shaped", size=6000, seed=4)
        s = collect(make_allocator(spec, k=8), env, UniformSampler(6000, seed=4), target_groups=160, seed=4).stats
        return s.rollouts / s.effective_groups

    assert cost("sara_continuous") < 0.95 * cost("ds")


def test_bounds_are_validated():
    with pytest.raises(Exception, match="high"):
        make_allocator("sara_continuous:low=1,high=0")


def test_user_errors_are_config_errors_naming_the_field():
    from sara.config import ConfigError
    from sara.envs.sim.continuous import continuous_reward_fn

    with pytest.raises(ConfigError, match="allocator 'sara_continuous': field 'prior'"):
        make_allocator("sara_continuous:prior=empirical", k=8)
    with pytest.raises(ConfigError, match="field 'high'"):
        make_allocator("sara_continuous:low=1,high=0", k=8)
    with pytest.raises(ConfigError, match="field 'noise'"):
        continuous_reward_fn(noise=-1.0)
