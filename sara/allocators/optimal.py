"""The cost-optimal stopping rule of ``sara``: abandon tables from a population prior, and an exact evaluator.

The within-step problem (one rollout at a time, a mixed prefix is committed and filled to ``k``): an unmixed prefix is
either continued or abandoned. Abandoning is worth doing exactly when the rollouts still needed to find out cost more
per expected effective group than the step achieves on average. With ``rho`` the best achievable rollouts per
effective group, the value of continuing an all-fail prefix of length ``n`` is (backward over ``n``)::

    V_f(k) = 0                                   # saturated: discarded, nothing gained
    cont   = 1 + q_n ((k - n - 1) - rho) + (1 - q_n) V_f(n + 1)     # q_n = P(next rollout succeeds | prefix)
    V_f(n) = min(0, cont)                        # abandon (0) when cont > 0

and symmetrically for all-success prefixes. ``rho`` solves ``V(0) = 0`` (Dinkelbach iterations); rule and ``rho``
together minimize expected rollouts per effective group under the prior, so under the true population the rule is
never worse than DS (never abandoning is one of the rules it chooses from). The prior is a ``GridPrior``
(``sara.priors.grid``), one mixture per group of prompts when it is grouped; one ``rho`` prices every group.

``rule_figures`` evaluates any such rule exactly on any population of success rates (the diagnosis and the tests).
"""

from __future__ import annotations

from typing import cast

import numpy as np

from sara.priors.grid import GridPrior, grid_loglik, p_mixed_given
from sara.types import Decision
from sara.units import UnitView

__all__ = ["RuleCache", "drain_decisions", "optimal_decisions", "optimal_tables", "rule_figures", "rule_tables",
           "solve_rho"]

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



class RuleCache:
    """``rule_tables`` of one allocator: ``rho`` is re-solved only when the prior's weights (or ``k``) changed."""

    def __init__(self) -> None:
        self._key: tuple[bytes, int] | None = None
        self._rho = 0.0

    def tables(self, prior: GridPrior, k: int) -> tuple[float, np.ndarray, np.ndarray]:
        """``rule_tables(prior, k)``, reusing the last ``rho`` while the prior is unchanged."""
        w, share = prior.group_weights(), prior.group_share()
        key = (w.tobytes() + share.tobytes(), k)
        if key != self._key:
            self._key, self._rho = key, solve_rho(w, prior.grid, k, share=share)[0]
        return self._rho, *optimal_tables(w, prior.grid, k, self._rho)


def rule_tables(prior: GridPrior, k: int) -> tuple[float, np.ndarray, np.ndarray]:
    """``(rho, abandon_fail [groups, k+1], abandon_success [groups, k+1])``: ``solve_rho`` over the prior's groups
    (one row for a pooled prior) and each group's tables at that optimum."""
    return RuleCache().tables(prior, k)


def optimal_decisions(base: GridPrior, units: UnitView, rule: tuple[float, np.ndarray, np.ndarray]) -> np.ndarray:
    """ABANDON / CONTINUE for unmixed prefixes: the population's rho prices each unit under its own posterior (its
    group's weights, times its own history's likelihood when it has one)."""
    k = units.k
    rho, ab_f, ab_s = rule
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
        ll = grid_loglik(base.grid, rows[:, 1], rows[:, 2])
        w = base.group_weights()[rows[:, 0].astype(np.int64)] * np.exp(ll - ll.max(1, keepdims=True))
        tf, ts = optimal_tables(w / np.maximum(w.sum(1, keepdims=True), 1e-300), base.grid, k, rho)
        inv = inv.reshape(-1)
        stop = np.where(fail, tf[inv, n], ts[inv, n])
    return np.where(stop, Decision.ABANDON, Decision.CONTINUE).astype(np.int8)


def drain_decisions(base: GridPrior, units: UnitView, rho: float) -> np.ndarray:
    """Once the target is covered: finish an unmixed prefix in one go iff its remaining rollouts per expected effective
    group beat the population's optimum, ``k - n < rho * P(mixed | prefix)`` (its rollouts so far are sunk)."""
    k = units.k
    table = units.table
    zeros = np.zeros(len(table))
    hs = table.prior.get("hist_s", zeros)[units.ids]
    hf = table.prior.get("hist_f", zeros)[units.ids]
    n = np.minimum(units.n, k).astype(np.float64)
    s = np.clip(np.rint(units.s), 0, n)
    w = base.group_weights()[base.unit_groups(table.pool_index[units.ids])]
    return cast(np.ndarray, (k - n) < rho * p_mixed_given(w, base.grid, n, s, k, hs, hf))
