"""Vectorized Beta-Binomial math for the binary effectiveness model.

A prompt with latent success rate ``p ~ Beta(a, b)`` that has shown ``s`` successes in ``n`` rollouts has posterior
``Beta(a + s, b + n - s)``. Rollouts are exchangeable, so the probability that the *completed* size-``k`` group is
mixed (has both a success and a failure) is::

    p_eff = 1 - P(all k fail | prefix) - P(all k succeed | prefix)
    P(all k fail | n, s)    = [s == 0] * B(a, b + k) / B(a, b + n)
    P(all k succeed | n, s) = [s == n] * B(a + k, b) / B(a + n, b)

For ``0 < s < n`` both terms vanish (the prefix is already mixed), for ``n == 0`` both apply. Computed with log-Beta
(``scipy.special.betaln``) so it stays exact for ``k`` in the thousands, and broadcast over any array shapes.
"""

from __future__ import annotations

from typing import cast

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import betaln, gammaln

__all__ = [
    "p_effective",
    "log_p_all_fail",
    "log_p_all_succeed",
    "beta_binomial_logpmf",
    "fit_beta_moments",
    "fit_beta_marginal_likelihood",
]


def log_p_all_fail(n: ArrayLike, s: ArrayLike, k: ArrayLike, alpha0: ArrayLike = 1.0, beta0: ArrayLike = 1.0) -> np.ndarray:
    """log P(rollouts n..k-1 all fail | n rollouts with s successes); ``-inf`` when s > 0."""
    n, s, k, a, b = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (n, s, k, alpha0, beta0)))
    with np.errstate(invalid="ignore"):
        out = betaln(a, b + k) - betaln(a, b + n)
    return np.where(s == 0, out, -np.inf)


def log_p_all_succeed(n: ArrayLike, s: ArrayLike, k: ArrayLike, alpha0: ArrayLike = 1.0, beta0: ArrayLike = 1.0) -> np.ndarray:
    """log P(rollouts n..k-1 all succeed | n rollouts with s successes); ``-inf`` when s < n."""
    n, s, k, a, b = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (n, s, k, alpha0, beta0)))
    with np.errstate(invalid="ignore"):
        out = betaln(a + k, b) - betaln(a + n, b)
    return np.where(s == n, out, -np.inf)


def p_effective(
    n: ArrayLike, s: ArrayLike, k: ArrayLike, alpha0: ArrayLike = 1.0, beta0: ArrayLike = 1.0
) -> np.ndarray | float:
    """Probability that a size-``k`` group whose first ``n`` rollouts had ``s`` successes ends up mixed.

    Args:
        n: Rollouts observed so far (``0 <= n <= k``). Any shape; broadcast with the others.
        s: Successes among them (``0 <= s <= n``).
        k: Full group size (``k >= 2``).
        alpha0: Beta prior pseudo-successes (> 0), scalar or per prompt.
        beta0: Beta prior pseudo-failures (> 0), scalar or per prompt.

    Returns:
        ``p_eff`` with the broadcast shape (a Python float when every input is a scalar). With
        ``alpha0 = beta0 = 1`` and an all-equal prefix of length ``n >= 1`` this is ``(k - n) / (k + 1)``.

    Example:
        >>> float(p_effective(4, 0, 8))  # (8 - 4) / 9
        0.4444444444444444
    """
    scalar = all(np.ndim(x) == 0 for x in (n, s, k, alpha0, beta0))
    lf = log_p_all_fail(n, s, k, alpha0, beta0)
    ls = log_p_all_succeed(n, s, k, alpha0, beta0)
    # 1 - e^lf - e^ls; clip tiny negative rounding (e.g. n == k, saturated: exactly 0).
    out = np.clip(1.0 - np.exp(lf) - np.exp(ls), 0.0, 1.0)
    return float(out) if scalar else out


def beta_binomial_logpmf(s: ArrayLike, n: ArrayLike, alpha: ArrayLike, beta: ArrayLike) -> np.ndarray:
    """log P(S = s) for S ~ BetaBinomial(n, alpha, beta), vectorized."""
    s, n, a, b = (np.asarray(x, dtype=np.float64) for x in (s, n, alpha, beta))
    log_choose = gammaln(n + 1) - gammaln(s + 1) - gammaln(n - s + 1)
    return cast(np.ndarray, log_choose + betaln(a + s, b + n - s) - betaln(a, b))


def fit_beta_moments(n: ArrayLike, s: ArrayLike, *, min_conc: float = 1e-2, max_conc: float = 1e4) -> tuple[float, float]:
    """Method-of-moments Beta fit to per-prompt success counts (``s_i`` of ``n_i``), corrected for binomial noise.

    Uses the unbiased estimate of the between-prompt variance of the latent rate:
    ``Var(p) ~= Var(s/n) - E[p(1-p)/n]``. Prompts with ``n < 2`` carry no variance information and only inform the mean.

    Returns:
        ``(alpha0, beta0)``; concentration clipped to ``[min_conc, max_conc]``. ``(1, 1)`` when there is no data.
    """
    n = np.asarray(n, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    keep = n > 0
    if not keep.any():
        return 1.0, 1.0
    n, s = n[keep], s[keep]
    rate = s / n
    m = float(np.clip(rate.mean(), 1e-4, 1 - 1e-4))
    if len(rate) < 2:
        return 1.0, 1.0
    # E[p(1-p)/n] estimated unbiasedly from each prompt: s(n-s) / (n (n-1) n) for n >= 2.
    nn = np.maximum(n, 2.0)
    noise = np.where(n >= 2, s * (n - s) / (nn * (nn - 1.0) * n), 0.0).mean()
    var_p = float(rate.var(ddof=1) - noise)
    var_p = min(max(var_p, m * (1 - m) / (max_conc + 1)), m * (1 - m) / (min_conc + 1))
    conc = m * (1 - m) / var_p - 1.0
    return m * conc, (1 - m) * conc


def fit_beta_marginal_likelihood(
    n: ArrayLike, s: ArrayLike, *, init: tuple[float, float] | None = None, max_conc: float = 1e4,
    weights: ArrayLike | None = None,
) -> tuple[float, float]:
    """Maximum marginal-likelihood Beta-Binomial fit (empirical Bayes), vectorized over prompts.

    Optimizes ``sum_i w_i log BetaBinomial(s_i | n_i, a, b)`` over ``(log a, log b)`` with L-BFGS-B, started at the
    method-of-moments estimate. Sequentially stopped prefixes are valid data: a stopping rule that depends only on
    the observed outcomes leaves the likelihood unchanged, so abandoned prompts' ``(n, s)`` can be pooled with full
    groups. ``weights`` (e.g. counts of identical ``(n, s)`` rows) default to 1.
    """
    from scipy.optimize import minimize

    n = np.asarray(n, dtype=np.float64)
    s = np.asarray(s, dtype=np.float64)
    w = np.ones_like(n) if weights is None else np.asarray(weights, dtype=np.float64)
    keep = (n > 0) & (w > 0)
    n, s, w = n[keep], s[keep], w[keep]
    if w.sum() < 2:
        return 1.0, 1.0
    if init is None:
        reps = np.rint(w).astype(np.int64) if weights is not None else None
        init = fit_beta_moments(np.repeat(n, reps), np.repeat(s, reps)) if reps is not None else fit_beta_moments(n, s)
    a0, b0 = init

    def nll(x: np.ndarray) -> float:
        a, b = np.exp(x)
        return -float(np.sum(w * (betaln(a + s, b + n - s) - betaln(a, b))))

    bound = (np.log(1e-3), np.log(max_conc))
    res = minimize(nll, np.log([max(a0, 1e-3), max(b0, 1e-3)]), method="L-BFGS-B", bounds=[bound, bound])
    a, b = np.exp(res.x)
    return float(a), float(b)
