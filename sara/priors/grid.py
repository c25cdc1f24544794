"""The nonparametric population prior: a mixture over a grid of success rates, fitted online by EM.

A Beta cannot put mass on "always solved" and "sometimes solved" at once, the shape of a trained policy's pool; a
mixture over a grid of success rates that includes 0 and 1 can. ``GridPrior`` fits its weights by EM to the (n, s)
counts of the units of the last ``window`` steps and of the running step. The sequence likelihood
``p^s (1 - p)^(n - s)`` does not depend on when a unit was stopped, so the fit is consistent under optional stopping
(a prefix cut after one failure is as valid a datum as a complete group). Per-prompt history (``hist_s``, ``hist_f`` in
a unit's prior) multiplies the grid weights by that prompt's likelihood (``p_mixed_given``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict, cast

import numpy as np

from sara.priors.base import Prior
from sara.units import UnitTable

__all__ = ["GRID_POINTS", "GridOptions", "GridPrior", "GridStart", "beta_on_grid", "count_pairs", "em_weights",
           "grid_loglik", "grid_posterior", "p_mixed_given"]

GRID_POINTS = 65


class GridStart(TypedDict, total=False):
    """The Beta a ``GridPrior`` starts from: options a prior built ``like`` a base does not copy from it."""

    alpha0: float
    beta0: float


class GridOptions(GridStart, total=False):
    """``GridPrior``'s options, as the priors built on it pass them on (``**kwargs: Unpack[GridOptions]``)."""

    fit: bool
    window: int
    min_units: int
    refit_growth: float
    smoothing: float


def _grid(points: int = GRID_POINTS) -> np.ndarray:
    return np.linspace(0.0, 1.0, points)


def beta_on_grid(alpha0: float, beta0: float, grid: np.ndarray) -> np.ndarray:
    """Beta(alpha0, beta0) discretized on ``grid`` (each point gets the mass of the cell around it)."""
    from scipy.special import betainc

    edges = np.concatenate([[0.0], (grid[1:] + grid[:-1]) / 2, [1.0]])
    w = np.diff(betainc(alpha0, beta0, edges))
    return cast(np.ndarray, w / w.sum())


def grid_loglik(grid: np.ndarray, s: np.ndarray, f: np.ndarray) -> np.ndarray:
    """``[m, G]`` log(p^s (1-p)^f) (0 * log 0 = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        lg, l1g = np.log(grid), np.log1p(-grid)
        out = np.where(s[:, None] > 0, s[:, None] * lg[None], 0.0) + np.where(f[:, None] > 0, f[:, None] * l1g[None], 0.0)
    return cast(np.ndarray, out)


def count_pairs(ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct rows of an integer ``ns [units, 2]`` in lexicographic order and their counts: what
    ``np.unique(ns, axis=0, return_counts=True)`` returns, by one ``bincount`` over ``n * width + s`` when the rows are
    small non-negative (n, s) counts (a sort of row views otherwise)."""
    ns = np.asarray(ns)
    if ns.dtype.kind in "iu" and len(ns) and ns.min() >= 0:
        width = int(ns[:, 1].max()) + 1
        if (int(ns[:, 0].max()) + 1) * width <= 1 << 20:
            counts = np.bincount(ns[:, 0] * width + ns[:, 1])
            keys = np.flatnonzero(counts)
            return np.stack([keys // width, keys % width], 1).astype(ns.dtype, copy=False), counts[keys]
    return np.unique(ns, axis=0, return_counts=True)


def em_weights(grid: np.ndarray, ns: np.ndarray, start: np.ndarray, prior: np.ndarray,
               counts: np.ndarray | None = None) -> np.ndarray:
    """MAP mixture weights on ``grid`` of the (n, s) rows ``ns [units, 2]`` by EM, from ``start``, with Dirichlet
    pseudo-counts ``prior [G]`` (the sequence likelihood ignores when a unit was stopped: optional stopping is fine).
    ``counts``: a weight per row (default: one unit each)."""
    if not len(ns):
        return cast(np.ndarray, prior / prior.sum())
    if counts is None:
        pairs, counts = count_pairs(ns)
    else:
        pairs, counts = np.asarray(ns), np.asarray(counts, np.float64)
    lik = np.exp(grid_loglik(grid, pairs[:, 1], pairs[:, 0] - pairs[:, 1]))  # [pairs, G]
    w = start.copy()
    for _ in range(200):
        r = lik * w[None]
        r /= np.maximum(r.sum(1, keepdims=True), 1e-300)
        new = (counts @ r + prior) / (counts.sum() + prior.sum())
        done = np.abs(new - w).max() < 1e-7
        w = new
        if done:
            break
    return w


class GridPrior(Prior):
    """Population prior: a mixture over success rates on a grid (0 and 1 included), fitted online by EM.

    Args:
        alpha0: With ``beta0``, the Beta the weights start from (used until ``min_units`` units have data).
        beta0: See ``alpha0``.
        fit: Fit to data (False: stay at the discretized Beta, the ``prior=constant`` case).
        window: Past steps kept for the fit (the running step is always added).
        min_units: Units with data needed before the first fit.
        refit_growth: Within a step, refit when the rollouts observed grew by this factor since the last fit.
        smoothing: Pseudo-units spread uniformly over the grid (keeps every rate possible).
    """

    def __init__(self, alpha0: float = 1.0, beta0: float = 1.0, *, fit: bool = True, window: int = 4,
                 min_units: int = 32, refit_growth: float = 1.25, smoothing: float = 1.0) -> None:
        self.grid = _grid()
        self.init = beta_on_grid(alpha0, beta0, self.grid)
        self.weights = self.init.copy()
        self.fit, self.window, self.min_units = bool(fit), int(window), int(min_units)
        self.refit_growth, self.smoothing = float(refit_growth), float(smoothing)
        self._hist: list[np.ndarray] = []  # per past step: [units, 2] (n, s) of every unit with data
        self._fitted_on = 0

    def _em(self, ns: np.ndarray) -> None:
        if not self.fit or len(ns) < self.min_units:
            return
        self.weights = em_weights(self.grid, ns, self.weights, np.full(len(self.grid), self.smoothing / len(self.grid)))

    def _data(self, table: UnitTable | None = None) -> np.ndarray:
        parts = list(self._hist)
        if table is not None:
            keep = table.n > 0
            parts.append(np.stack([table.n[keep], np.rint(table.rsum[keep])], 1).astype(np.int64))
        return np.concatenate(parts) if parts else np.zeros((0, 2), np.int64)

    def _refit(self, table: UnitTable | None) -> bool:
        """Fit to the history (+ the running step's units in ``table``); True when the weights changed."""
        before = self.weights
        self._em(self._data(table))
        return self.weights is not before

    def refresh(self, table: UnitTable) -> bool:
        """Refit on history + the running step when the data grew enough; True when the weights changed
        (``table.prior`` is left as admitted: the optimal rule reads the weights)."""
        data = int(table.n.sum()) + sum(int(h[:, 0].sum()) for h in self._hist)
        if not self.fit or data < self.refit_growth * max(self._fitted_on, 1):
            return False
        changed = self._refit(table)
        self._fitted_on = data
        return changed

    def mean_params(self) -> tuple[float, float]:
        """A Beta with the mixture's mean and variance (for code that reads alpha0 / beta0)."""
        m = float(self.weights @ self.grid)
        v = float(self.weights @ (self.grid - m) ** 2)
        c = max(m * (1 - m) / max(v, 1e-9) - 1.0, 1e-3)
        return max(m * c, 1e-3), max((1 - m) * c, 1e-3)

    def unit_groups(self, pool_index: np.ndarray) -> np.ndarray:
        """Group index of each pool index (one population: all 0; ``GroupedGridPrior`` has several)."""
        return np.zeros(len(pool_index), np.int64)

    def group_weights(self) -> np.ndarray:
        """``[groups, G]`` grid weights of every group (here one row, the population)."""
        return self.weights[None]

    def group_share(self) -> np.ndarray:
        """``[groups]`` how often each group is drawn (here one group)."""
        return np.ones(1)

    # ---- Prior interface -----------------------------------------------------------------------------------------
    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        a, b = self.mean_params()
        m = len(pool_index)
        return {"alpha0": np.full(m, a), "beta0": np.full(m, b)}

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        n = np.asarray(n, np.int64)
        keep = n > 0
        self._hist.append(np.stack([n[keep], np.rint(np.asarray(rsum, np.float64)[keep])], 1).astype(np.int64))
        del self._hist[: -self.window]
        self._refit(None)
        self._fitted_on = 0

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights.tolist(), "hist": [h.tolist() for h in self._hist], "fitted_on": self._fitted_on}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        self.weights = np.asarray(state["weights"], np.float64).copy()
        self._hist = [np.asarray(h, np.int64).reshape(-1, 2).copy() for h in state["hist"]]
        self._fitted_on = int(state["fitted_on"])


def grid_posterior(weights: np.ndarray, grid: np.ndarray, s: np.ndarray, f: np.ndarray) -> np.ndarray:
    """``[m, G]`` posterior over ``grid`` of m prompts with ``s`` successes and ``f`` failures (``[m]`` each) under
    grid mixtures ``weights`` (``[G]``, or one row per prompt)."""
    ll = grid_loglik(grid, np.asarray(s, np.float64), np.asarray(f, np.float64))
    post = np.atleast_2d(weights) * np.exp(ll - ll.max(1, keepdims=True))
    return cast(np.ndarray, post / np.maximum(post.sum(1, keepdims=True), 1e-300))


def p_mixed_given(weights: np.ndarray, grid: np.ndarray, n: np.ndarray, s: np.ndarray, k: int,
                  hist_s: np.ndarray | float = 0.0, hist_f: np.ndarray | float = 0.0) -> np.ndarray:
    """P(the full size-k group is mixed | a prefix of n rollouts with s successes) under grid mixtures ``weights``
    (``[G]`` or one row per prefix), each prompt's history evidence (``hist_s`` / ``hist_f``) counted with its
    prefix."""
    n = np.asarray(n, np.float64)
    s = np.asarray(s, np.float64)
    post = grid_posterior(weights, grid, hist_s + s, hist_f + n - s)
    rest = (k - n)[:, None]
    same = np.where((s == 0)[:, None], (1.0 - grid)[None] ** rest, grid[None] ** rest)
    return np.where((s > 0) & (s < n), 1.0, 1.0 - (post * same).sum(1))


