"""``sara_paper``: the paper's two-threshold rule on the Beta-Binomial p_eff (arXiv 2607.26253).

ABANDON a unit when p_eff < ``tau_low`` (0.45: with the uniform prior at k=8, after 4 identical outcomes), COMMIT it
early (stop probing, fill the group) once p_eff >= ``tau_high``, else CONTINUE; a mixed prefix is committed by the
template. The default prior is the paper's uniform Beta(1, 1); 'empirical' and 'history' priors are fitted online.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, model_validator

from sara.allocators.sara import PriorKind, PriorOptions, SARABase, reject_rule_option
from sara.priors.base import ConstantPrior, Prior
from sara.priors.beta import EmpiricalBayesPrior
from sara.priors.history import HistoryPrior
from sara.priors.posteriors import p_effective
from sara.types import Decision
from sara.units import UnitView

__all__ = ["SARAPaperAllocator", "SARAPaperConfig"]


class SARAPaperConfig(PriorOptions):
    """Options of ``sara_paper`` (the fixed thresholds; its default prior is 'constant', the paper's uniform)."""

    other_rules: ClassVar[Mapping[str, str]] = {"group_by": "sara", "drain": "sara", "audit": "sara",
                                                "audit_seed": "sara"}
    tau_low: float = Field(0.45, ge=0.0, le=1.0)
    """ABANDON a unit whose p_eff falls below this. With the uniform prior at k=8, 0.45 abandons after 4 identical
    outcomes; P(wrong abandon) <= tau_low under the prior."""
    tau_high: float = Field(1.0, ge=0.0, le=1.0)
    """COMMIT (stop probing, fill the group) once p_eff >= tau_high even before the prefix is mixed. 1.0 = never."""

    @model_validator(mode="before")
    @classmethod
    def _no_rule_option(cls, data: Any) -> Any:
        return reject_rule_option(data, "sara_paper")

    @model_validator(mode="after")
    def _check_taus(self) -> SARAPaperConfig:
        if self.tau_low > self.tau_high:
            raise ValueError(f"tau_low ({self.tau_low}) must be <= tau_high ({self.tau_high}); lower tau_low or raise tau_high")
        return self


class SARAPaperAllocator(SARABase):
    """COMMIT a mixed prefix (or one with p_eff >= tau_high); ABANDON when p_eff < tau_low; else CONTINUE."""

    name = "sara_paper"
    Config: ClassVar[type[SARAPaperConfig]] = SARAPaperConfig
    config: SARAPaperConfig
    default_prior: ClassVar[PriorKind] = "constant"

    def make_prior(self, kind: PriorKind) -> Prior:
        c = self.config.internals
        if kind == "constant":
            return ConstantPrior(c.alpha0, c.beta0)
        base = EmpiricalBayesPrior(c.alpha0, c.beta0)
        return HistoryPrior(c.decay, base, max_evidence=c.max_evidence) if kind == "history" else base

    def population_prior(self) -> Prior:
        return EmpiricalBayesPrior(self.config.internals.alpha0, self.config.internals.beta0)

    def decide(self, units: UnitView) -> np.ndarray:
        abandon = units.p_eff < self.config.tau_low
        if self.prior_kind != "constant":
            if self.prior.refresh(units.table):  # the prior refit within the step: p_eff under the new one
                units = self._view(units.ids)
            # A learned prior can put p_eff below tau_low before any evidence (a population where most prompts
            # saturate): abandon only once the prompt's own outcomes lowered p_eff by 10% or more, else every unit
            # would go after its first rollout, which says next to nothing under a symmetric prior.
            abandon = (units.p_eff < self.config.tau_low) & (units.p_eff < 0.9 * _prior_p_eff(units))
        out = np.full(len(units.ids), Decision.CONTINUE, np.int8)
        out[units.p_eff >= self.config.tau_high] = Decision.COMMIT
        out[abandon] = Decision.ABANDON
        return out


def _prior_p_eff(units: UnitView) -> np.ndarray:
    """p_eff of each unit before any rollout (its prior's probability of a mixed group)."""
    a = units.table.prior.get("alpha0", np.ones(len(units.table)))[units.ids]
    b = units.table.prior.get("beta0", np.ones(len(units.table)))[units.ids]
    return np.asarray(p_effective(0, 0, units.k, a, b))
