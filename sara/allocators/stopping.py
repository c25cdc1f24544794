"""The cost-optimal stopping rule of ``sara`` (``rule=optimal``), its population prior, and an exact evaluator.

The within-step problem (one rollout at a time, a mixed prefix is committed and filled to ``k``): an unmixed prefix is
either continued or abandoned. Abandoning is worth doing exactly when the rollouts still needed to find out cost more
per expected effective group than the step achieves on average. With ``rho`` the best achievable rollouts per
effective group, the value of continuing an all-fail prefix of length ``n`` is (backward over ``n``)::

    V_f(k) = 0                                   # saturated: discarded, nothing gained
    cont   = 1 + q_n ((k - n - 1) - rho) + (1 - q_n) V_f(n + 1)     # q_n = P(next rollout succeeds | prefix)
    V_f(n) = min(0, cont)                        # abandon (0) when cont > 0

and symmetrically for all-success prefixes. ``rho`` solves ``V(0) = 0`` (Dinkelbach iterations); rule and ``rho``
together minimize expected rollouts per effective group under the prior, so under the true population the rule is
never worse than DS (never abandoning is one of the rules it chooses from).

The prior is nonparametric (``GridPrior``): a mixture over a grid of success rates that includes 0 and 1, fitted by EM
to the (n, s) counts of the units of the last ``window`` steps and of the running step. The sequence likelihood
``p^s (1 - p)^(n - s)`` does not depend on when a unit was stopped, so the fit is consistent under optional stopping.
A Beta fit cannot put mass on "always solved" and "sometimes solved" at once, the shape of a trained policy's pool.
Per-prompt history (``hist_s``, ``hist_f`` in a unit's prior: ``HistoryPrior`` or a predictive sampler's posterior)
multiplies the grid weights by that prompt's likelihood; the population's ``rho`` prices every prompt.

``rule_figures`` evaluates any such rule exactly on any population of success rates (the diagnosis and the tests).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sara.allocators.base import Prior, UnitTable
from sara.allocators.units import UnitView
from sara.types import Decision

__all__ = ["GridPrior", "drain_decisions", "em_weights", "optimal_tables", "p_mixed_given", "rule_figures", "solve_rho", "optimal_decisions"]

GRID_POINTS = 65


def _grid(points: int = GRID_POINTS) -> np.ndarray:
    return np.linspace(0.0, 1.0, points)


def beta_on_grid(alpha0: float, beta0: float, grid: np.ndarray) -> np.ndarray:
    """Beta(alpha0, beta0) discretized on ``grid`` (each point gets the mass of the cell around it)."""
    from scipy.special import betainc

    edges = np.concatenate([[0.0], (grid[1:] + grid[:-1]) / 2, [1.0]])
    w = np.diff(betainc(alpha0, beta0, edges))
    return w / w.sum()


def _loglik(grid: np.ndarray, s: np.ndarray, f: np.ndarray) -> np.ndarray:
    """``[m, G]`` log(p^s (1-p)^f) (0 * log 0 = 0)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        lg, l1g = np.log(grid), np.log1p(-grid)
        out = np.where(s[:, None] > 0, s[:, None] * lg[None], 0.0) + np.where(f[:, None] > 0, f[:, None] * l1g[None], 0.0)
    return out


def em_weights(grid: np.ndarray, ns: np.ndarray, start: np.ndarray, prior: np.ndarray,
               counts: np.ndarray | None = None) -> np.ndarray:
    """MAP mixture weights on ``grid`` of the (n, s) rows ``ns [units, 2]`` by EM, from ``start``, with Dirichlet
    pseudo-counts ``prior [G]`` (the sequence likelihood ignores when a unit was stopped: optional stopping is fine).
    ``counts``: a weight per row (default: one unit each)."""
    if not len(ns):
        return prior / prior.sum()
    if counts is None:
        pairs, counts = np.unique(ns, axis=0, return_counts=True)
    else:
        pairs, counts = np.asarray(ns), np.asarray(counts, np.float64)
    lik = np.exp(_loglik(grid, pairs[:, 1], pairs[:, 0] - pairs[:, 1]))  # [pairs, G]
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


def optimal_tables(weights: np.ndarray, grid: np.ndarray, k: int, rho: float) -> tuple[np.ndarray, np.ndarray]:
    """Abandon tables ``[m, k+1]`` of the all-fail and the all-success path for each row of ``weights [m, G]``.

    Entry ``n`` says whether a prefix of ``n`` identical outcomes is abandoned (``n`` in 1..k-1; 0 and k never).
    """
    w = np.atleast_2d(np.asarray(weights, np.float64))
    out = []
    for g in (grid, 1.0 - grid):  # fail path: next "success" mixes with P = p; success path: with P = 1 - p
        ab = np.zeros((len(w), k + 1), bool)
        v_next = np.zeros(len(w))
        for n in range(k - 1, 0, -1):
            u = w * (1.0 - g)[None] ** n  # posterior (unnormalized) after n identical outcomes
            z = u.sum(1)
            q = np.divide((u * g[None]).sum(1), z, out=np.zeros_like(z), where=z > 0)
            cont = 1.0 + q * ((k - n - 1) - rho) + (1.0 - q) * v_next
            ab[:, n] = cont > 1e-9
            v_next = np.minimum(0.0, cont)
        out.append(ab)
    return out[0], out[1]


def rule_figures(abandon_fail: np.ndarray, abandon_succ: np.ndarray, p: np.ndarray, k: int,
                 weights: np.ndarray | None = None, *, signal: bool = False) -> dict[str, float]:
    """Exact expected figures per prompt drawn of a stopping rule (probe 1, complete groups) on a population.

    Args:
        abandon_fail: ``[k+1]`` bool, abandon an all-fail prefix of length n.
        abandon_succ: ``[k+1]`` bool, abandon an all-success prefix of length n.
        p: Success rates of the population (samples or grid points).
        k: Group size.
        weights: Probability of each entry of ``p`` (default uniform).
        signal: Also compute ``signal``: E[sum over effective groups of sqrt(q (1 - q))], q the group's success rate
            (a GRPO group's sum of |advantage| is ``2 k sqrt(q (1 - q))``).

    Returns:
        ``rollouts``, ``effective``, ``abandoned``, ``wrong_abandons`` (abandoned prefixes whose full group would have
        mixed), ``rollouts_per_effective_group``, ``ds_rollouts_per_effective_group`` (k / P(mixed)),
        ``ratio_vs_ds``, ``wrong_abandon_rate`` and, with ``signal``, ``signal`` and ``ds_signal``.
    """
    p = np.asarray(p, np.float64)
    w = np.full(len(p), 1.0 / len(p)) if weights is None else np.asarray(weights, np.float64) / np.sum(weights)
    cost = eff = ab = wrong = sig = 0.0
    j = np.arange(k + 1)
    sq = np.sqrt(j / k * (1 - j / k))
    if signal:
        from scipy.stats import binom
    for table, x in ((np.asarray(abandon_fail, bool), p), (np.asarray(abandon_succ, bool), 1.0 - p)):
        # x: P(the outcome that mixes this path); the path's own outcome has probability 1 - x.
        stop = next((n for n in range(1, k) if table[n]), k)
        m = np.arange(1, stop)  # mixes at rollout m + 1 after m identical outcomes
        pm = (1.0 - x)[:, None] ** m[None] * x[:, None]
        eff += float(w @ pm.sum(1))
        cost += k * float(w @ pm.sum(1))
        reach = (1.0 - x) ** stop
        if stop < k:
            ab += float(w @ reach)
            wrong += float(w @ (reach * (1.0 - (1.0 - x) ** (k - stop))))
        cost += stop * float(w @ reach)
        if signal and len(m):
            # Successes of the mixing outcome's kind in the group: 1 + Bin(k - m - 1, x); sqrt(q(1-q)) is symmetric.
            pmf = binom.pmf(j[None, None, :] - 1, (k - m - 1)[None, :, None], x[:, None, None])
            sig += float(w @ ((pm[:, :, None] * pmf) @ sq).sum(1))
    ds_eff = float(w @ (1.0 - p**k - (1.0 - p) ** k))
    out = {"rollouts": cost, "effective": eff, "abandoned": ab, "wrong_abandons": wrong,
           "rollouts_per_effective_group": cost / eff if eff > 0 else float("inf"),
           "ds_rollouts_per_effective_group": k / ds_eff if ds_eff > 0 else float("inf"),
           "wrong_abandon_rate": wrong / ab if ab > 0 else 0.0}
    out["ratio_vs_ds"] = out["rollouts_per_effective_group"] / out["ds_rollouts_per_effective_group"]
    if signal:
        out["signal"] = sig
        out["ds_signal"] = float(w @ (np.stack([np.asarray(binom.pmf(jj, k, p)) for jj in j], 1) @ sq))
    return out


def solve_rho(weights: np.ndarray, grid: np.ndarray, k: int, iters: int = 40,
              share: np.ndarray | None = None) -> tuple[float, np.ndarray, np.ndarray]:
    """Dinkelbach: the optimal rollouts per effective group under the prior, and the rule that achieves it.

    ``weights [G]`` is one population (tables ``[k+1]``); ``weights [groups, G]`` with ``share [groups]`` (how often
    each group is drawn; default equal) is one optimum over several groups, each stopped by its own table
    (``[groups, k+1]``)."""
    w = np.atleast_2d(np.asarray(weights, np.float64))
    single = np.ndim(weights) == 1
    sh = np.full(len(w), 1.0 / len(w)) if share is None else np.asarray(share, np.float64)

    def ratio(ab_f: np.ndarray, ab_s: np.ndarray) -> float:
        figs = [rule_figures(ab_f[g], ab_s[g], grid, k, w[g]) for g in range(len(w))]
        eff = float(sh @ [f["effective"] for f in figs])
        return float(sh @ [f["rollouts"] for f in figs]) / eff if eff > 0 else float("inf")

    never = np.zeros((len(w), k + 1), bool)
    rho = ratio(never, never)
    if not np.isfinite(rho):  # nothing ever mixes under the prior: abandon as early as possible
        ab_f = np.zeros((len(w), k + 1), bool)
        ab_f[:, 1:k] = True
        ab_s = ab_f.copy()
    else:
        for _ in range(iters):
            ab_f, ab_s = optimal_tables(w, grid, k, rho)
            new = ratio(ab_f, ab_s)
            if abs(new - rho) <= 1e-12 * rho:
                break
            rho = new
    return (rho, ab_f[0], ab_s[0]) if single else (rho, ab_f, ab_s)


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
        self._rho_cache: tuple[bytes, int, float] | None = None

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
        """Refit on history + the running step when the data grew enough; True when the weights changed."""
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

    def rho(self, k: int) -> tuple[float, np.ndarray, np.ndarray]:
        """``(rho, abandon_fail [groups, k+1], abandon_success [groups, k+1])``: ``solve_rho`` over the groups'
        weights (one row here), cached, and each group's tables at that optimum."""
        w, share = self.group_weights(), self.group_share()
        key = w.tobytes() + share.tobytes()
        if self._rho_cache is None or self._rho_cache[0] != key or self._rho_cache[1] != k:
            self._rho_cache = (key, k, solve_rho(w, self.grid, k, share=share)[0])
        return self._rho_cache[2], *optimal_tables(w, self.grid, k, self._rho_cache[2])

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


def optimal_decisions(base: GridPrior, units: UnitView) -> np.ndarray:
    """ABANDON / CONTINUE for unmixed prefixes: the population's rho prices each unit under its own posterior (its
    group's weights, times its own history's likelihood when it has one)."""
    k = units.k
    rho, ab_f, ab_s = base.rho(k)
    table = units.table
    hs = table.prior.get("hist_s")
    hf = table.prior.get("hist_f")
    n = np.minimum(units.n, k)
    fail = np.rint(units.s) == 0
    group = base.unit_groups(table.pool_index[units.ids])
    if hs is None or hf is None or not (np.any(hs[units.ids]) or np.any(hf[units.ids])):
        stop = np.where(fail, ab_f[group, n], ab_s[group, n])
    else:  # per-prompt history: one table per distinct (group, successes, failures)
        ev = np.round(np.stack([group, hs[units.ids], hf[units.ids]], 1), 3)
        rows, inv = np.unique(ev, axis=0, return_inverse=True)
        ll = _loglik(base.grid, rows[:, 1], rows[:, 2])
        w = base.group_weights()[rows[:, 0].astype(np.int64)] * np.exp(ll - ll.max(1, keepdims=True))
        tf, ts = optimal_tables(w / np.maximum(w.sum(1, keepdims=True), 1e-300), base.grid, k, rho)
        inv = inv.reshape(-1)
        stop = np.where(fail, tf[inv, n], ts[inv, n])
    return np.where(stop, Decision.ABANDON, Decision.CONTINUE).astype(np.int8)


def p_mixed_given(weights: np.ndarray, grid: np.ndarray, n: np.ndarray, s: np.ndarray, k: int,
                  hist_s: np.ndarray | float = 0.0, hist_f: np.ndarray | float = 0.0) -> np.ndarray:
    """P(the full size-k group is mixed | a prefix of n rollouts with s successes) under grid mixtures ``weights``
    (``[G]`` or one row per prefix), each prompt's history evidence (``hist_s`` / ``hist_f``) counted with its
    prefix."""
    n = np.asarray(n, np.float64)
    s = np.asarray(s, np.float64)
    ll = _loglik(grid, hist_s + s, hist_f + n - s)
    post = np.atleast_2d(weights) * np.exp(ll - ll.max(1, keepdims=True))
    post /= np.maximum(post.sum(1, keepdims=True), 1e-300)
    rest = (k - n)[:, None]
    same = np.where((s == 0)[:, None], (1.0 - grid)[None] ** rest, grid[None] ** rest)
    return np.where((s > 0) & (s < n), 1.0, 1.0 - (post * same).sum(1))


def drain_decisions(base: GridPrior, units: UnitView) -> np.ndarray:
    """Once the target is covered: finish an unmixed prefix in one go iff its remaining rollouts per expected effective
    group beat the population's optimum, ``k - n < rho * P(mixed | prefix)`` (its rollouts so far are sunk)."""
    k = units.k
    rho = base.rho(k)[0]
    table = units.table
    zeros = np.zeros(len(table))
    hs = table.prior.get("hist_s", zeros)[units.ids]
    hf = table.prior.get("hist_f", zeros)[units.ids]
    n = np.minimum(units.n, k).astype(np.float64)
    s = np.clip(np.rint(units.s), 0, n)
    w = base.group_weights()[base.unit_groups(table.pool_index[units.ids])]
    return (k - n) < rho * p_mixed_given(w, base.grid, n, s, k, hs, hf)
