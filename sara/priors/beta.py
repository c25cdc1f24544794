"""Empirical Bayes over the population: one Beta(alpha0, beta0) fitted to the success counts seen so far.

``EmpiricalBayesPrior`` fits one Beta to the (n, s) counts of the prompts of the last ``window`` steps plus the
running step. The default fit is the Beta-Binomial marginal likelihood: under any stopping rule that looks only at the
observed outcomes (SARA's probes, abandonment after a few identical outcomes) the likelihood of a unit's sequence is
``B(a + s, b + n - s) / B(a, b)`` whatever its length, so the fit stays consistent on truncated groups. The method of
moments is offered too; it is biased by optional stopping. ``refresh(table)`` refits within a step and rewrites the
open units' priors in place, so the prior is useful from the first rounds of the first step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sara.config import ConfigError
from sara.priors.base import Prior
from sara.priors.posteriors import fit_beta_marginal_likelihood, fit_beta_moments
from sara.units import UnitTable

__all__ = ["EmpiricalBayesPrior"]


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
