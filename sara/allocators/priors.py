"""Priors that know something: empirical Bayes over the population, and per-prompt history with decay.

Both plug into any ``SequentialAllocator`` through the ``Prior`` interface of ``sara.allocators.base``:
``params(pool_index)`` gives each admitted unit its Beta(alpha0, beta0), ``update(...)`` learns from a finished step.

* ``EmpiricalBayesPrior`` fits one Beta(alpha0, beta0) to the success counts of the prompts seen so far (the last
  ``window`` steps plus the running step). The default fit is the Beta-Binomial marginal likelihood: under any stopping
  rule that looks only at the observed outcomes (SARA's probes, abandonment after a few identical outcomes) the
  likelihood of a unit's sequence is ``B(a + s, b + n - s) / B(a, b)`` whatever its length, so the fit stays
  consistent on truncated groups. The method of moments is offered too; it is biased by optional stopping.
* ``HistoryPrior`` gives a prompt seen before its own discounted posterior (MoPPS-style):
  ``alpha = alpha_base + lambda^dt * successes_seen``, ``beta = beta_base + lambda^dt * failures_seen``, where ``dt`` is
  the number of steps since the evidence was gathered (decay per step, so stale evidence fades toward the population)
  and the base is an empirical-Bayes fit (or a constant). A prompt that failed 8/8 last epoch starts with a small p_eff
  and is abandoned after one rollout.

Within the first step there is no history: ``refresh(table)`` refits on the running step's units (called by the
allocator before it decides) and rewrites the priors of the open units in place, so an empirical-Bayes prior is
useful from the first rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sara.allocators.base import ConstantPrior, Prior, UnitTable, UnitView
from sara.allocators.posteriors import fit_beta_marginal_likelihood, fit_beta_moments
from sara.config import ConfigError

__all__ = ["BorrowedHistory", "EmpiricalBayesPrior", "HistoryPrior", "make_prior", "prior_p_eff", "refresh_units", "refreshed_view", "PRIOR_KINDS"]

PRIOR_KINDS = ("constant", "empirical", "history")


class EmpiricalBayesPrior(Prior):
    """One Beta(alpha0, beta0) for every prompt, fitted to the observed population of success counts.

    Args:
        alpha0: Starting pseudo-successes (used until there is data).
        beta0: Starting pseudo-failures.
        method: ``"ml"`` (Beta-Binomial marginal likelihood, robust to optional stopping) or ``"moments"``.
        window: Past steps kept for the fit (the running step is always added). Small windows track drift.
        min_units: Units with data needed before the first fit.
        refit_growth: Within a step, refit when the rollouts observed grew by this factor since the last fit.
    """

    def __init__(self, alpha0: float = 1.0, beta0: float = 1.0, *, method: str = "ml", window: int = 4,
                 min_units: int = 32, refit_growth: float = 1.25) -> None:
        if method not in ("ml", "moments"):
            raise ConfigError(f"EmpiricalBayesPrior: field 'method': must be 'ml' or 'moments' (got {method!r})")
        if window < 1:
            raise ConfigError(f"EmpiricalBayesPrior: field 'window': must be >= 1 (got {window})")
        self.init = (float(alpha0), float(beta0))
        self.alpha0, self.beta0 = self.init
        self.method = method
        self.window = int(window)
        self.min_units = int(min_units)
        self.refit_growth = float(refit_growth)
        self._hist_n: list[np.ndarray] = []  # per past step: n and s of every unit with data
        self._hist_s: list[np.ndarray] = []
        self._fitted_on = 0  # rollouts observed at the last fit (history + running step)

    # ---- fitting -------------------------------------------------------------------------------------------------
    def _fit(self, n: np.ndarray, s: np.ndarray) -> None:
        keep = n > 0
        if int(keep.sum()) < self.min_units:
            return
        n, s = n[keep], s[keep]
        if self.method == "ml":
            self.alpha0, self.beta0 = fit_beta_marginal_likelihood(n, s, init=(self.alpha0, self.beta0))
        else:
            self.alpha0, self.beta0 = fit_beta_moments(n, s)

    def fit_counts(self, n: np.ndarray, s: np.ndarray) -> None:
        """Fit to one (possibly fractional, decayed) count pair per prompt, replacing the unit history."""
        self._hist_n, self._hist_s = [], []
        self._fit(np.asarray(n, np.float64), np.asarray(s, np.float64))

    def _data(self, n: np.ndarray | None = None, s: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        ns = self._hist_n + ([n] if n is not None else [])
        ss = self._hist_s + ([s] if s is not None else [])
        if not ns:
            return np.zeros(0), np.zeros(0)
        return np.concatenate(ns).astype(np.float64), np.concatenate(ss).astype(np.float64)

    def refresh(self, table: UnitTable) -> bool:
        """Refit on history + the running step's units; rewrite ``table.prior`` in place. True when it changed."""
        units = int((table.n > 0).sum()) + sum(len(h) for h in self._hist_n)
        data = int(table.n.sum()) + sum(int(h.sum()) for h in self._hist_n)
        if units < self.min_units or data < self.refit_growth * max(self._fitted_on, 1):
            return False
        before = (self.alpha0, self.beta0)
        self._fit(*self._data(table.n, np.rint(table.rsum)))
        self._fitted_on = data
        if (self.alpha0, self.beta0) == before:
            return False
        self._rewrite(table)
        return True

    def _rewrite(self, table: UnitTable) -> None:
        table.prior["alpha0"] = np.full(len(table), self.alpha0)
        table.prior["beta0"] = np.full(len(table), self.beta0)

    # ---- Prior interface -----------------------------------------------------------------------------------------
    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        m = len(pool_index)
        return {"alpha0": np.full(m, self.alpha0), "beta0": np.full(m, self.beta0)}

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        n = np.asarray(n, np.int64)
        keep = n > 0
        self._hist_n.append(n[keep].copy())
        self._hist_s.append(np.rint(np.asarray(rsum, np.float64)[keep]).astype(np.int64))
        del self._hist_n[: -self.window], self._hist_s[: -self.window]
        self._fit(*self._data())
        self._fitted_on = 0  # the next step starts a fresh within-step schedule

    def state_dict(self) -> dict[str, Any]:
        return {"alpha0": self.alpha0, "beta0": self.beta0, "hist_n": [h.copy() for h in self._hist_n],
                "hist_s": [h.copy() for h in self._hist_s], "fitted_on": self._fitted_on}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        self.alpha0, self.beta0 = float(state["alpha0"]), float(state["beta0"])
        self._hist_n = [np.asarray(h, np.int64).copy() for h in state["hist_n"]]
        self._hist_s = [np.asarray(h, np.int64).copy() for h in state["hist_s"]]
        self._fitted_on = int(state["fitted_on"])


class HistoryPrior(Prior):
    """Per-prompt discounted Beta posterior on top of a population prior (MoPPS-style decay per step).

    Args:
        decay: lambda in (0, 1]: evidence from ``dt`` steps ago counts ``lambda**dt`` times (1 = never forget).
        base: Population prior for unseen prompts and the floor of every prompt's prior (default: empirical Bayes).
        max_evidence: Cap on a prompt's decayed pseudo-count (keeps a prompt revisitable after drift).
    """

    def __init__(self, decay: float = 0.7, base: Prior | None = None, *, max_evidence: float = 64.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ConfigError(f"HistoryPrior: field 'decay': must be in (0, 1] (got {decay})")
        self.decay = float(decay)
        self.base: Prior = base if base is not None else EmpiricalBayesPrior()
        self.max_evidence = float(max_evidence)
        self.succ = np.zeros(0)  # decayed successes per pool index, as of last_step
        self.fail = np.zeros(0)
        self.last_step = np.zeros(0, np.int64)
        self.step = 0  # the step the next params() are for

    def _grow(self, size: int) -> None:
        if size > len(self.succ):
            extra = size - len(self.succ)
            self.succ = np.concatenate([self.succ, np.zeros(extra)])
            self.fail = np.concatenate([self.fail, np.zeros(extra)])
            self.last_step = np.concatenate([self.last_step, np.zeros(extra, np.int64)])

    def evidence(self, pool_index: np.ndarray, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Decayed (successes, failures) of each prompt as seen from ``step`` (default: the coming step)."""
        idx = np.asarray(pool_index, np.int64)
        self._grow(int(idx.max()) + 1 if len(idx) else 0)
        step = self.step if step is None else step
        w = self.decay ** np.maximum(step - self.last_step[idx], 0)
        return self.succ[idx] * w, self.fail[idx] * w

    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        base = self.base.params(pool_index)
        s, f = self.evidence(pool_index)
        return {"alpha0": base["alpha0"] + s, "beta0": base["beta0"] + f, "hist_s": s, "hist_f": f}

    def refresh(self, table: UnitTable) -> bool:
        """Before any history exists, refit the base within the step (if it can) and rewrite the units' priors."""
        refresh = getattr(self.base, "refresh", None)
        if refresh is None or self.succ.sum() + self.fail.sum() > 0 or not refresh(table):
            return False
        base = self.base.params(table.pool_index)
        hs = table.prior.get("hist_s", np.zeros(len(table)))
        hf = table.prior.get("hist_f", np.zeros(len(table)))
        table.prior["alpha0"] = base["alpha0"] + hs
        table.prior["beta0"] = base["beta0"] + hf
        return True

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        idx = np.asarray(pool_index, np.int64)
        cnt = np.asarray(n, np.float64)
        s = np.rint(np.asarray(rsum, np.float64))
        keep = cnt > 0  # units without delivered rollouts (aborted, carried on) carry no evidence
        idx, cnt, s = idx[keep], cnt[keep], s[keep]
        if len(idx):
            self._grow(int(idx.max()) + 1)
            u = np.unique(idx)
            # Bring the touched prompts' evidence to `step`, then add this step's counts.
            w = self.decay ** np.maximum(step - self.last_step[u], 0)
            self.succ[u] *= w
            self.fail[u] *= w
            self.last_step[u] = step
            np.add.at(self.succ, idx, s)
            np.add.at(self.fail, idx, cnt - s)
            tot = self.succ[u] + self.fail[u]
            scale = np.minimum(1.0, self.max_evidence / np.maximum(tot, 1e-12))
            self.succ[u] *= scale
            self.fail[u] *= scale
        if isinstance(self.base, EmpiricalBayesPrior):
            # Fit the population to one (decayed) count pair per prompt: a prompt the sampler favours is not counted
            # once per visit, which would bias the population toward the favoured prompts.
            seen = self.succ + self.fail >= 1.0
            self.base.fit_counts(self.succ[seen] + self.fail[seen], self.succ[seen])
        else:
            self.base.update(pool_index, n, rsum, step)
        self.step = step + 1

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base.state_dict(), "succ": self.succ.copy(), "fail": self.fail.copy(),
                "last_step": self.last_step.copy(), "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        self.base.load_state_dict(state["base"])
        self.succ = np.asarray(state["succ"], np.float64).copy()
        self.fail = np.asarray(state["fail"], np.float64).copy()
        self.last_step = np.asarray(state["last_step"], np.int64).copy()
        self.step = int(state["step"])


class BorrowedHistory(Prior):
    """Per-prompt priors read from another component's ``HistoryPrior`` (a predictive sampler's posterior).

    ``params`` = the base population prior plus the history's decayed evidence (``hist_s`` / ``hist_f``), like
    ``HistoryPrior``; ``update`` only teaches the base (the owner of the history updates it), and ``state_dict`` holds
    only the base (the owner checkpoints the history). Built by ``sara.allocators.compose``.

    Args:
        history: The shared per-prompt history.
        base: Population prior for the evidence to sit on.
    """

    def __init__(self, history: HistoryPrior, base: Prior) -> None:
        self.history = history
        self.base = base

    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        base = self.base.params(pool_index)
        s, f = self.history.evidence(pool_index)
        return {"alpha0": base["alpha0"] + s, "beta0": base["beta0"] + f, "hist_s": s, "hist_f": f}

    def refresh(self, table: UnitTable) -> bool:
        """Refit the base within the step (when it can) and rewrite the units' priors."""
        if not refresh_units(self.base, table):
            return False
        base = self.base.params(table.pool_index)
        table.prior["alpha0"] = base["alpha0"] + table.prior.get("hist_s", np.zeros(len(table)))
        table.prior["beta0"] = base["beta0"] + table.prior.get("hist_f", np.zeros(len(table)))
        return True

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        self.base.update(pool_index, n, rsum, step)

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            self.base.load_state_dict(state["base"])


def make_prior(kind: str, *, alpha0: float = 1.0, beta0: float = 1.0, decay: float = 0.7,
               max_evidence: float = 64.0) -> Prior:
    """``"constant"`` -> ``ConstantPrior``; ``"empirical"`` -> ``EmpiricalBayesPrior``; ``"history"`` ->
    ``HistoryPrior`` over an empirical-Bayes base. ``alpha0``/``beta0`` are the constant prior or the starting point."""
    if kind == "constant":
        return ConstantPrior(alpha0, beta0)
    if kind == "empirical":
        return EmpiricalBayesPrior(alpha0, beta0)
    if kind == "history":
        return HistoryPrior(decay, EmpiricalBayesPrior(alpha0, beta0), max_evidence=max_evidence)
    raise ConfigError(f"prior: field 'prior': unknown prior {kind!r}; known: {', '.join(PRIOR_KINDS)}")


def refresh_units(prior: Prior, table: UnitTable) -> bool:
    """Ask ``prior`` to refit within the step (when it can); True when the units' priors changed."""
    refresh = getattr(prior, "refresh", None)
    return bool(refresh(table)) if refresh is not None else False


def prior_p_eff(units: UnitView) -> np.ndarray:
    """p_eff of each unit before any rollout (its prior's probability of a mixed group)."""
    from sara.allocators.posteriors import p_effective

    a = units.table.prior.get("alpha0", np.ones(len(units.table)))[units.ids]
    b = units.table.prior.get("beta0", np.ones(len(units.table)))[units.ids]
    return np.asarray(p_effective(0, 0, units.k, a, b))


def refreshed_view(allocator: Any, units: UnitView) -> UnitView:
    """``units`` with p_eff recomputed when ``allocator.prior`` refits within the step (else ``units`` unchanged)."""
    if not refresh_units(allocator.prior, units.table):
        return units
    p_eff = allocator.model.p_effective(units.table, units.ids, units.k)
    return UnitView(ids=units.ids, n=units.n, s=units.s, k=units.k, p_eff=p_eff, table=units.table)
