import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import comb

from sara.allocators import p_effective
from sara.priors.posteriors import fit_beta_marginal_likelihood, fit_beta_moments


def brute_p_eff(n: int, s: int, k: int, a: float, b: float) -> float:
    """Exact by summing the Beta-Binomial predictive of the remaining k - n rollouts (float, small k only)."""
    from scipy.special import betaln

    m = k - n
    if 0 < s < n:
        return 1.0
    total = 0.0
    for j in range(m + 1):
        prob = comb(m, j) * np.exp(betaln(a + s + j, b + n - s + m - j) - betaln(a + s, b + n - s))
        final = s + j
        if 0 < final < k:
            total += prob
    return total


def test_uniform_prior_closed_form():
    k = 8
    n = np.arange(1, k)
    np.testing.assert_allclose(p_effective(n, 0, k), (k - n) / (k + 1), rtol=1e-12)
    np.testing.assert_allclose(p_effective(n, n, k), (k - n) / (k + 1), rtol=1e-12)
    # p_eff(0) == p_eff(1) under the uniform prior: the first rollout alone is uninformative
    assert p_effective(0, 0, k) == pytest.approx(p_effective(1, 0, k))
    assert p_effective(0, 0, k) == pytest.approx((k - 1) / (k + 1))
    np.testing.assert_allclose(p_effective(np.arange(1, 8), 0, 8), [.778, .667, .556, .444, .333, .222, .111], atol=1e-3)


def test_mixed_and_complete():
    assert p_effective(3, 1, 8) == 1.0
    assert p_effective(8, 0, 8) == 0.0
    assert p_effective(8, 8, 8) == 0.0
    assert p_effective(8, 3, 8) == 1.0


@pytest.mark.parametrize("a,b", [(1.0, 1.0), (0.15, 0.15), (2.0, 0.5), (0.3, 3.0)])
@pytest.mark.parametrize("k", [2, 5, 8, 16])
def test_against_exact_sum(a, b, k):
    for n in range(0, k + 1):
        for s in (0, n):
            assert p_effective(n, s, k, a, b) == pytest.approx(brute_p_eff(n, s, k, a, b), abs=1e-10)


@pytest.mark.parametrize("a,b,n,s", [(0.15, 0.15, 3, 0), (2.0, 0.5, 2, 2), (1.0, 1.0, 0, 0), (0.5, 2.0, 4, 4)])
def test_against_monte_carlo(a, b, n, s):
    rng = np.random.default_rng(0)
    k, draws = 8, 400_000
    p = rng.beta(a, b, draws)
    r = rng.random((draws, k)) < p[:, None]
    prefix_s = r[:, :n].sum(1)
    keep = prefix_s == s
    tot = r[keep].sum(1)
    mc = np.mean((tot > 0) & (tot < k))
    se = np.sqrt(mc * (1 - mc) / keep.sum())
    assert abs(p_effective(n, s, k, a, b) - mc) < 5 * se + 1e-3


def test_large_k_exact_and_stable():
    k = 4096
    n = np.array([1, 10, 100, 1000, 4000, 4096])
    np.testing.assert_allclose(p_effective(n, 0, k), (k - n) / (k + 1), rtol=1e-9)
    v = p_effective(n, n, k, 0.15, 0.15)
    assert np.all(np.isfinite(v)) and np.all((v >= 0) & (v <= 1))
    assert np.all(np.diff(v) <= 1e-12)  # more identical outcomes -> less likely to mix


def test_vectorized_broadcasting_and_scalar_type():
    out = p_effective(np.array([[1], [2]]), 0, 8, np.array([1.0, 0.5, 2.0]), 1.0)
    assert out.shape == (2, 3)
    assert isinstance(p_effective(2, 0, 8), float)


@settings(max_examples=200, deadline=None)
@given(k=st.integers(2, 64), data=st.data(), a=st.floats(0.05, 20), b=st.floats(0.05, 20))
def test_property_bounds_and_monotone(k, data, a, b):
    n = data.draw(st.integers(1, k - 1))
    p_fail = p_effective(n, 0, k, a, b)
    assert 0.0 <= p_fail <= 1.0
    assert p_effective(n + 1, 0, k, a, b) <= p_fail + 1e-12


def test_fits_recover_prior():
    rng = np.random.default_rng(1)
    p = rng.beta(0.6, 1.4, 20_000)
    n = np.full(p.shape, 8)
    s = rng.binomial(n, p)
    a, b = fit_beta_moments(n, s)
    assert a / (a + b) == pytest.approx(0.3, abs=0.02)
    assert a + b == pytest.approx(2.0, rel=0.2)
    a2, b2 = fit_beta_marginal_likelihood(n, s)
    assert a2 == pytest.approx(0.6, rel=0.1) and b2 == pytest.approx(1.4, rel=0.1)
