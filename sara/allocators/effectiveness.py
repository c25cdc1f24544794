"""Effectiveness models: a unit's sufficient statistics -> (a) is its prefix already effective? (b) P(the completed
size-k group is effective). The binary Beta-Binomial model is the default; continuous rewards and trees plug in their
own (``sara.allocators.continuous``, ``sara.allocators.tree``), nothing else changes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import cast

import numpy as np

from sara.priors.posteriors import p_effective
from sara.units import UnitTable

__all__ = ["BinaryEffectiveness", "EffectivenessModel"]


class EffectivenessModel(ABC):
    """Turns a unit's sufficient statistics into 'already effective?' and P(completed group effective).

    Attributes:
        reward_range: ``(low, high)``, the rewards the model is defined on (inclusive; infinite ends: any finite
            reward). An allocator built on the model refuses others at the protocol's boundary.
    """

    reward_range: tuple[float, float] = (-np.inf, np.inf)

    @abstractmethod
    def is_mixed(self, table: UnitTable, idx: np.ndarray, eps: float) -> np.ndarray:
        """Boolean ``[len(idx)]``: the observed prefix is already an effective group."""

    @abstractmethod
    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray:
        """Float ``[len(idx)]``: probability that the completed size-k group is effective."""


class BinaryEffectiveness(EffectivenessModel):
    """0/1 rewards, Beta(alpha0, beta0) prior per unit (``table.prior``), closed-form ``p_effective``. Rewards in
    [0, 1] are accepted (a partial score, such as Countdown's ``format_score``, counts as its rounded outcome)."""

    reward_range = (0.0, 1.0)

    def is_mixed(self, table: UnitTable, idx: np.ndarray, eps: float) -> np.ndarray:
        return cast(np.ndarray, (table.rmax[idx] - table.rmin[idx]) > eps)

    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray:
        a = table.prior.get("alpha0", np.ones(len(table)))[idx]
        b = table.prior.get("beta0", np.ones(len(table)))[idx]
        # Binary: successes = reward sum (rewards are rounded to {0,1} by construction of the task).
        return np.asarray(p_effective(table.n[idx], np.rint(table.rsum[idx]), k, a, b), dtype=np.float64)
