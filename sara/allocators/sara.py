"""SARA: Sequential Adaptive Rollout Allocation (two-threshold rule on the Beta-Binomial p_eff)."""

from __future__ import annotations

import numpy as np
from pydantic import Field, model_validator

from sara.allocators.base import SequentialAllocator, SequentialConfig, UnitView
from sara.types import Decision

__all__ = ["SARAAllocator", "SARAConfig"]


class SARAConfig(SequentialConfig):
    """SARA's thresholds (on top of the sequential template's options)."""

    tau_low: float = Field(0.45, ge=0.0, le=1.0)
    """ABANDON a unit whose p_eff falls below this. With the uniform prior at k=8, 0.45 abandons after 4 identical
    outcomes; P(wrong abandon) <= tau_low under the prior."""
    tau_high: float = Field(1.0, ge=0.0, le=1.0)
    """COMMIT (stop probing, fill the group) once p_eff >= tau_high even before the prefix is mixed. 1.0 = never."""

    @model_validator(mode="after")
    def _check_taus(self) -> SARAConfig:
        if self.tau_low > self.tau_high:
            raise ValueError(f"tau_low ({self.tau_low}) must be <= tau_high ({self.tau_high}); lower tau_low or raise tau_high")
        return self


class SARAAllocator(SequentialAllocator):
    """COMMIT a mixed prefix; ABANDON when p_eff < tau_low; COMMIT when p_eff >= tau_high; else CONTINUE."""

    name = "sara"
    Config = SARAConfig
    config: SARAConfig

    def decide(self, units: UnitView) -> np.ndarray:
        out = np.full(len(units.ids), Decision.CONTINUE, np.int8)
        out[units.p_eff >= self.config.tau_high] = Decision.COMMIT
        out[units.p_eff < self.config.tau_low] = Decision.ABANDON
        return out
