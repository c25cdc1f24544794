"""Continuous (bounded) rewards: an effectiveness model, the ``sara_continuous`` allocator and a simulator population.

A group is effective when its reward std exceeds ``eps``. With rewards in ``[low, high]`` a group carries no signal
essentially only when every rollout hits the same boundary (all ``low``: nothing works; all ``high``: solved), or when
the prompt's rewards are (nearly) deterministic inside the range. The model:

* each rollout falls in one of three categories: the atom at ``low`` (within ``atol``), the atom at ``high``, or the
  interior; per prompt the category probabilities are Dirichlet(``a_low``, ``a_high``, ``a_mid``). Aggregating the
  Dirichlet gives Beta-Binomial closed forms: ``P(rest all low | n all low) = B(a_low + k, a_rest) /
  B(a_low + n, a_rest)`` with ``a_rest = a_high + a_mid`` (the binary formula of ``posteriors.p_effective``);
* interior rewards of one prompt have spread ``sigma`` with an inverse-gamma prior (``sigma_shape``,
  ``sigma_scale``); after ``n`` interior rewards with sum of squared deviations ``SS``, ``sigma^2 | data ~
  InvGamma(shape + (n - 1) / 2, scale + SS / 2)`` and the completed group has std <= eps about when sigma <= eps:
  ``P = Q(shape', scale' / eps^2)`` (regularized upper incomplete gamma) -- the one approximation (the sample std of
  k draws is replaced by sigma);
* ``p_eff = 1 - P(non-effective | prefix)`` per prefix kind (all low / all high / interior / empty), all vectorized.

A prefix is *already effective* when its range exceeds ``eps * sqrt(2k)``: a set of k values with range R has std at
least ``R / sqrt(2k)`` (two extremes, the rest at the midpoint), so the completed group is effective whatever comes.

The simulator with continuous rewards is ``sara.envs.sim.continuous.make_continuous_env``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np
from pydantic import Field, field_validator, model_validator
from scipy.special import gammaincc

from sara.allocators.effectiveness import EffectivenessModel
from sara.allocators.paper import SARAPaperAllocator, SARAPaperConfig
from sara.allocators.sara import PriorOptions
from sara.priors.base import Prior
from sara.priors.history import HistoryPrior
from sara.priors.posteriors import log_p_all_succeed
from sara.units import UnitTable

__all__ = ["ContinuousConfig", "ContinuousEffectiveness", "ContinuousSARAAllocator"]


class ContinuousEffectiveness(EffectivenessModel):
    """Effectiveness of bounded continuous rewards (see the module docstring for the model).

    Args:
        k: Group size (for the already-effective test).
        eps: Std tolerance of an effective group.
        low, high: Reward bounds.
        atol: Distance from a bound that counts as hitting it.
        a_low, a_high, a_mid: Dirichlet prior of the (low atom, high atom, interior) categories.
        sigma_shape, sigma_scale: Inverse-gamma prior of the interior spread's variance.
    """

    def __init__(self, *, k: int, eps: float, low: float = 0.0, high: float = 1.0, atol: float = 1e-9,
                 a_low: float = 0.25, a_high: float = 0.25, a_mid: float = 0.5, sigma_shape: float = 1.0,
                 sigma_scale: float = 0.01) -> None:
        self.k, self.eps, self.low, self.high, self.atol = int(k), float(eps), float(low), float(high), float(atol)
        self.a_low, self.a_high, self.a_mid = float(a_low), float(a_high), float(a_mid)
        self.sigma_shape, self.sigma_scale = float(sigma_shape), float(sigma_scale)
        self.reward_range = (self.low - self.atol, self.high + self.atol)

    def is_mixed(self, table: UnitTable, idx: np.ndarray, eps: float) -> np.ndarray:
        rng = table.rmax[idx] - table.rmin[idx]
        return cast(np.ndarray, (table.n[idx] >= 2) & (rng > max(eps, self.eps) * np.sqrt(2.0 * self.k)))

    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray:
        n = table.n[idx].astype(np.float64)
        rmin, rmax = table.rmin[idx], table.rmax[idx]
        some = n > 0
        all_low = some & (rmax <= self.low + self.atol)
        all_high = some & (rmin >= self.high - self.atol) & ~all_low
        interior = some & ~all_low & ~all_high
        zero = np.zeros_like(n)
        a_rest_low = self.a_high + self.a_mid
        a_rest_high = self.a_low + self.a_mid
        a_rest_mid = self.a_low + self.a_high
        # P(every remaining rollout lands in the prefix's category), Beta-Binomial on the aggregated Dirichlet;
        # for an empty prefix, P(all k in that category).
        p_low = np.exp(log_p_all_succeed(np.where(all_low | ~some, n, 0), np.where(all_low | ~some, n, 0), k,
                                         self.a_low, a_rest_low))
        p_high = np.exp(log_p_all_succeed(np.where(all_high | ~some, n, 0), np.where(all_high | ~some, n, 0), k,
                                          self.a_high, a_rest_high))
        n_mid = np.where(interior, n, zero)
        p_mid = np.exp(log_p_all_succeed(n_mid, n_mid, k, self.a_mid, a_rest_mid))
        ss = np.where(interior, np.maximum(table.rsq[idx] - table.rsum[idx] ** 2 / np.maximum(n, 1.0), 0.0), 0.0)
        shape = self.sigma_shape + np.maximum(n_mid - 1.0, 0.0) / 2.0
        scale = self.sigma_scale + ss / 2.0
        p_tight = gammaincc(shape, scale / max(self.eps, 1e-300) ** 2)
        p_none = np.where(all_low, p_low, np.where(all_high, p_high, np.where(interior, p_mid * p_tight,
                                                                              p_low + p_high + p_mid * p_tight)))
        return np.clip(1.0 - p_none, 0.0, 1.0)


class ContinuousConfig(SARAPaperConfig):
    """The paper's thresholds on continuous rewards (as in ``sara_paper``), plus the reward model's prior."""

    low: float = 0.0
    """Lower reward bound."""
    high: float = 1.0
    """Upper reward bound (must exceed ``low``)."""
    atol: float = Field(1e-9, ge=0.0)
    """A reward within atol of a bound counts as the boundary atom."""
    a_low: float = Field(0.25, gt=0.0)
    """Dirichlet pseudo-count of rollouts at the lower bound."""
    a_high: float = Field(0.25, gt=0.0)
    """Dirichlet pseudo-count of rollouts at the upper bound."""
    a_mid: float = Field(0.5, gt=0.0)
    """Dirichlet pseudo-count of interior rollouts."""
    sigma_shape: float = Field(1.0, gt=0.0)
    """Inverse-gamma shape of the interior reward variance."""
    sigma_scale: float = Field(0.01, gt=0.0)
    """Inverse-gamma scale of the interior reward variance (prior mean of sigma^2 for shape > 1)."""

    @field_validator("prior")
    @classmethod
    def _only_constant_prior(cls, v: str | None) -> str | None:
        if v not in (None, "constant"):
            raise ValueError("only 'constant' is supported (the reward model has its own prior: a_low, a_high, a_mid, "
                             "sigma_shape, sigma_scale)")
        return v

    @model_validator(mode="after")
    def _check_bounds(self) -> ContinuousConfig:
        if not self.high > self.low:
            raise ValueError(f"field 'high': must be greater than field 'low' (got high={self.high}, low={self.low})")
        return self


class ContinuousSARAAllocator(SARAPaperAllocator):
    """``sara_continuous``: the paper's COMMIT / ABANDON / CONTINUE thresholds on ``ContinuousEffectiveness``'s p_eff.

    Works unchanged on 0/1 rewards (both values are boundary atoms). The empirical / history Beta priors of
    ``sara_paper`` do not apply: the reward model has its own prior fields, and it borrows no sampler history.
    """

    name = "sara_continuous"
    Config = ContinuousConfig
    config: ContinuousConfig

    def __init__(self, config: ContinuousConfig | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 history: HistoryPrior | None = None, **overrides: object) -> None:
        super().__init__(config, prior=prior, history=history, **overrides)
        self._build_model()

    @classmethod
    def reads_history(cls, config: PriorOptions) -> bool:
        """Never: the reward model has its own prior fields."""
        return False

    def _build_model(self) -> None:
        c = self.config
        self.model = ContinuousEffectiveness(k=c.k, eps=c.internals.eps, low=c.low, high=c.high, atol=c.atol,
                                             a_low=c.a_low, a_high=c.a_high, a_mid=c.a_mid,
                                             sigma_shape=c.sigma_shape, sigma_scale=c.sigma_scale)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._build_model()
