"""SARA: Sequential Adaptive Rollout Allocation (two-threshold rule on the Beta-Binomial p_eff)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from sara.allocators.base import Prior
from sara.allocators.sequential import SequentialAllocator, SequentialConfig
from sara.allocators.units import UnitView
from sara.types import Decision

__all__ = ["SARAAllocator", "SARAConfig"]


class SARAConfig(SequentialConfig):
    """SARA's thresholds (on top of the sequential template's options)."""

    tau_low: float = Field(0.45, ge=0.0, le=1.0)
    """ABANDON a unit whose p_eff falls below this. With the uniform prior at k=8, 0.45 abandons after 4 identical
    outcomes; P(wrong abandon) <= tau_low under the prior."""
    tau_high: float = Field(1.0, ge=0.0, le=1.0)
    """COMMIT (stop probing, fill the group) once p_eff >= tau_high even before the prefix is mixed. 1.0 = never."""
    prior: Literal["constant", "empirical", "history"] = "constant"
    """Where p_eff's Beta prior comes from: 'constant' (alpha0, beta0), 'empirical' (Beta fitted online to the
    population seen so far, marginal likelihood), 'history' (each prompt's own posterior from earlier steps, decayed
    by ``decay`` per step, over an empirical-Bayes base). See ``sara.allocators.priors``."""
    decay: float = Field(0.7, gt=0.0, le=1.0)
    """History prior only: weight of evidence per step of age (lambda in MoPPS; 1 = never forget)."""
    max_evidence: float = Field(64.0, gt=0.0)
    """History prior only: cap on a prompt's decayed pseudo-count, so stale evidence cannot outweigh what the running
    step sees when the policy has moved (lower under fast drift)."""

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

    def __init__(self, config: SARAConfig | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 **overrides: Any) -> None:
        super().__init__(config, prior=prior, **overrides)
        if prior is None and self.config.prior != "constant":
            from sara.allocators.priors import make_prior

            c = self.config
            self.prior = make_prior(c.prior, alpha0=c.alpha0, beta0=c.beta0, decay=c.decay, max_evidence=c.max_evidence)

    def decide(self, units: UnitView) -> np.ndarray:
        abandon = units.p_eff < self.config.tau_low
        if self.config.prior != "constant":
            from sara.allocators.priors import prior_p_eff, refreshed_view

            units = refreshed_view(self, units)
            # A learned prior can put p_eff below tau_low before any evidence (a population where most prompts
            # saturate): abandon only once the prompt's own outcomes lowered p_eff by 10% or more, else every unit
            # would go after its first rollout, which says next to nothing under a symmetric prior.
            abandon = (units.p_eff < self.config.tau_low) & (units.p_eff < 0.9 * prior_p_eff(units))
        out = np.full(len(units.ids), Decision.CONTINUE, np.int8)
        out[units.p_eff >= self.config.tau_high] = Decision.COMMIT
        out[abandon] = Decision.ABANDON
        return out
