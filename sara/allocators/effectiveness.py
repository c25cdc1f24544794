"""Effectiveness models: a unit's sufficient statistics -> (a) is its prefix already effective? (b) P(the completed
size-k group is effective). The binary Beta-Binomial model is the default; continuous rewards and trees plug in their
own (``sara.allocators.continuous``, ``sara.allocators.tree``), nothing else changes."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from sara.priors.posteriors import p_effective
from sara.units import UnitTable

__all__ = ["BinaryEffectiveness", "EffectivenessModel"]


class EffectivenessModel(ABC):
    """Turns a unit's sufficient statistics into 'already effective?' and P(completed group effective)."""

    @abstractmethod
    def is_mixed(self, table: UnitTable, idx: np.ndarray, eps: float) -> np.ndarray:
        """Boolean ``[len(idx)]``: the observed prefix is already an effective group."""

    @abstractmethod
    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray:
        """Float ``[len(idx)]``: probability that the completed size-k group is effective."""


class BinaryEffectiveness(EffectivenessModel):
    """0/1 rewards, Beta(alpha0, beta0) prior per unit (``table.prior``), closed-form ``p_effective``."""

    def is_mixed(self, table: UnitTable, idx: np.ndarray, eps: float) -> np.ndarray:
        return (table.rmax[idx] - table.rmin[idx]) > eps

    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray:
        a = table.prior.get("alpha0", np.ones(len(table)))[idx]
        b = table.prior.get("beta0", np.ones(len(table)))[idx]
        # Binary: successes = reward sum (rewards are rounded to {0,1} by construction of the task).
        return np.asarray(p_effective(table.n[idx], np.rint(table.rsum[idx]), k, a, b), dtype=np.float64)
