"""SARA: Sequential Adaptive Rollout Allocation.

Two stopping rules on the same template (probe one rollout at a time, commit a mixed prefix and fill it to k):

* ``rule=optimal`` (the default): abandon an unmixed prefix exactly when finishing it costs more rollouts per expected
  effective group than the step achieves on average, under a population prior fitted online (a mixture over a grid of
  success rates, ``sara.allocators.stopping``). It minimizes expected rollouts per effective group under the fitted
  population, so it is never worse than DS there (on a mostly-mixed population it never abandons and IS DS).
* ``rule=paper``: the paper's two thresholds on the Beta-Binomial p_eff: ABANDON when p_eff < ``tau_low`` (0.45),
  COMMIT early when p_eff >= ``tau_high``. Reach it with ``sara:rule=paper`` or by giving ``tau_low`` / ``tau_high``
  (``sara:tau_low=0.45`` is the paper's rule with its uniform prior).

``prior`` picks where the prior comes from; unset, it is ``empirical`` for the optimal rule and ``constant`` (uniform)
for the paper's. With a predictive sampler, ``sara.allocators.compose`` hands the sampler's per-prompt history to an
allocator whose spec does not set ``prior`` (SARA + predictive selection in one switch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from sara.allocators.base import Prior
from sara.allocators.sequential import SequentialAllocator, SequentialConfig
from sara.allocators.units import UnitView
from sara.types import Decision

__all__ = ["SARAAllocator", "SARAConfig"]

PriorKind = Literal["constant", "empirical", "history"]


class SARAConfig(SequentialConfig):
    """SARA's stopping rule and prior (on top of the sequential template's options)."""

    rule: Literal["optimal", "paper"] | None = None
    """'optimal': abandon when finishing a prefix costs more rollouts per expected effective group than the step's
    optimum under the fitted population (``sara.allocators.stopping``). 'paper': the thresholds ``tau_low`` /
    ``tau_high``. None: 'paper' when ``tau_low`` or ``tau_high`` is given, else 'optimal'."""
    tau_low: float = Field(0.45, ge=0.0, le=1.0)
    """Paper rule: ABANDON a unit whose p_eff falls below this. With the uniform prior at k=8, 0.45 abandons after 4
    identical outcomes; P(wrong abandon) <= tau_low under the prior. Giving it selects the paper rule."""
    tau_high: float = Field(1.0, ge=0.0, le=1.0)
    """Paper rule: COMMIT (stop probing, fill the group) once p_eff >= tau_high even before the prefix is mixed.
    1.0 = never."""
    prior: PriorKind | None = None
    """Where the prior comes from: 'constant' (Beta(alpha0, beta0)), 'empirical' (fitted online to the population seen
    so far: a grid mixture for the optimal rule, a Beta for the paper's), 'history' (each prompt's own posterior from
    earlier steps, decayed by ``decay`` per step, over the empirical base). None: 'empirical' for the optimal rule,
    'constant' for the paper's; with a predictive sampler, the sampler's history (``sara.allocators.compose``)."""
    decay: float = Field(0.7, gt=0.0, le=1.0)
    """History prior only: weight of evidence per step of age (lambda in MoPPS; 1 = never forget)."""
    audit: float = Field(0.04, ge=0.0, le=1.0)
    """Optimal rule: share of units never abandoned (chosen by a hash of step and prompt, seeded by ``audit_seed``).
    Their complete groups keep the population fit identifiable: from prefixes cut after one failure alone, p = 0
    and p = 0.1 look alike, the fit drifts toward the latter and the rule swings to abandoning nothing for a step.
    They cost DS's price per group (0.04: +1-2% rollouts per effective group in the simulator; see
    docs/allocation.md for the measurements behind the value)."""
    audit_seed: int = Field(0, ge=0)
    """Seed of the audit draw."""
    group_by: str | None = "component"
    """Optimal rule: a ``Prompt.metadata`` key whose values split the population prior into groups (one grid mixture
    per value, shrunk toward the pooled fit, one optimum across them; ``sara.allocators.grouped``), e.g.
    ``component`` (``sara/Mixture-v0``), ``digits`` (``sara/Arithmetic-v0``), ``level`` (MATH). Needs the pool's
    prompts, which ``sara.allocators.compose(..., prompts=)`` hands over (the trainer and the benches do). The default,
    ``component``, groups a mixture's components and leaves any other pool (or a composition without prompts) one
    population; a key you give must exist. None: one population."""
    drain: bool = True
    """Optimal rule: once the step's target is covered, finish the units still probing whose remaining rollouts buy
    effective groups below the optimum (True), or discard them (False). Draining lowers rollouts per effective group,
    but every drained group that mixes is surplus over the target: a larger batch, not another step."""
    max_evidence: float = Field(64.0, gt=0.0)
    """History prior only: cap on a prompt's decayed pseudo-count, so stale evidence cannot outweigh what the running
    step sees when the policy has moved (lower under fast drift)."""

    @field_validator("group_by", mode="before")
    @classmethod
    def _none_key(cls, v: Any) -> Any:
        return None if isinstance(v, str) and v.strip().lower() in ("", "none") else v  # spec strings: group_by=none

    @model_validator(mode="after")
    def _check_taus(self) -> SARAConfig:
        if self.tau_low > self.tau_high:
            raise ValueError(f"tau_low ({self.tau_low}) must be <= tau_high ({self.tau_high}); lower tau_low or raise tau_high")
        if "group_by" in self.model_fields_set and self.group_by is not None and self.resolved_rule() != "optimal":
            raise ValueError("group_by splits the optimal rule's population prior; drop it or use rule=optimal")
        if self.rule == "optimal" and {"tau_low", "tau_high"} & self.model_fields_set:
            raise ValueError("tau_low / tau_high are the paper rule's thresholds; drop them or use rule=paper")
        return self

    def resolved_rule(self, default: Literal["optimal", "paper"] = "optimal") -> Literal["optimal", "paper"]:
        """The rule in force (see ``rule``); ``default`` when neither ``rule`` nor a threshold is given."""
        if self.rule is not None:
            return self.rule
        return "paper" if {"tau_low", "tau_high"} & self.model_fields_set else default

    def resolved_prior(self, rule: Literal["optimal", "paper"]) -> PriorKind:
        """The prior in force under ``rule`` before any composition with a sampler (see ``prior``)."""
        if self.prior is not None:
            return self.prior
        return "empirical" if rule == "optimal" else "constant"


class SARAAllocator(SequentialAllocator):
    """COMMIT a mixed prefix; ABANDON by the optimal rule (default) or the paper's thresholds; else CONTINUE."""

    name = "sara"
    Config = SARAConfig
    config: SARAConfig
    default_rule: ClassVar[Literal["optimal", "paper"]] = "optimal"
    """The rule when the spec gives neither ``rule`` nor a threshold (subclasses with their own p_eff: 'paper')."""
    borrows_history: ClassVar[bool] = True
    """Whether ``compose`` may hand this allocator a sampler's per-prompt history."""

    def __init__(self, config: SARAConfig | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 **overrides: Any) -> None:
        super().__init__(config, prior=prior, **overrides)
        c = self.config
        self.rule = c.resolved_rule(self.default_rule)
        self.prior_kind: PriorKind = c.resolved_prior(self.rule)
        if prior is not None:
            return
        if self.rule == "optimal":
            from sara.allocators.priors import HistoryPrior
            from sara.allocators.stopping import GridPrior

            base = GridPrior(c.alpha0, c.beta0, fit=self.prior_kind != "constant")
            self.prior = (HistoryPrior(c.decay, base, max_evidence=c.max_evidence) if self.prior_kind == "history"
                          else base)
        elif self.prior_kind != "constant":
            from sara.allocators.priors import make_prior

            self.prior = make_prior(self.prior_kind, alpha0=c.alpha0, beta0=c.beta0, decay=c.decay,
                                    max_evidence=c.max_evidence)

    def borrow_history(self, history: Any) -> bool:
        """Take per-prompt priors from ``history`` (a sampler's ``HistoryPrior``) unless the spec set ``prior``.

        Called by ``sara.allocators.compose``; True when the allocator now reads the sampler's history.
        """
        if self.config.prior is not None or not self.borrows_history:
            return False
        from sara.allocators.priors import BorrowedHistory, EmpiricalBayesPrior
        from sara.allocators.stopping import GridPrior

        c = self.config
        base = GridPrior(c.alpha0, c.beta0) if self.rule == "optimal" else EmpiricalBayesPrior(c.alpha0, c.beta0)
        self.prior = BorrowedHistory(history, base)
        self.prior_kind = "history"
        return True

    @property
    def group_by_given(self) -> bool:
        """Whether the spec set ``group_by`` to a key (then the pool's prompts are required, see ``compose``)."""
        return "group_by" in self.config.model_fields_set and self.config.group_by is not None

    def group_prompts(self, prompts: Sequence[Any]) -> bool:
        """Split the population prior by ``Prompt.metadata[group_by]`` over the pool ``prompts`` (indexed by pool
        index). Called by ``sara.allocators.compose``; False (nothing changed) when ``group_by`` is unset."""
        key = self.config.group_by
        if key is None or self.rule != "optimal":
            return False
        from sara.allocators.grouped import GroupedGridPrior, group_labels
        from sara.allocators.stopping import GridPrior

        if not self.group_by_given and not _has_key(prompts, key):
            return False  # the default key on a pool without it: one population
        labels, names = group_labels(prompts, key)
        holder = self.prior if isinstance(self.prior, GridPrior) else getattr(self.prior, "base", None)
        if not isinstance(holder, GridPrior):
            raise TypeError(f"sara: group_by needs a grid prior to split, got {type(holder).__name__}")
        grouped = GroupedGridPrior.like(holder, labels, names)
        if holder is self.prior:
            self.prior = grouped
        else:
            self.prior.base = grouped  # type: ignore[union-attr]
        return True

    def drain(self, units: UnitView) -> np.ndarray:
        """Optimal rule: finish the units in flight whose remaining rollouts buy effective groups below the optimum."""
        if self.rule != "optimal" or not self.config.drain:
            return super().drain(units)
        from sara.allocators.stopping import drain_decisions

        return drain_decisions(getattr(self.prior, "base", self.prior), units)

    def decide(self, units: UnitView) -> np.ndarray:
        if self.rule == "optimal":
            from sara.allocators.priors import refresh_units
            from sara.allocators.stopping import optimal_decisions
            from sara.seeding import derive_seeds, uniform_from_seeds

            refresh_units(self.prior, units.table)
            out = optimal_decisions(getattr(self.prior, "base", self.prior), units)
            if self.config.audit > 0:
                pool = units.table.pool_index[units.ids]
                audit = uniform_from_seeds(derive_seeds(self.config.audit_seed, self.step, pool)) < self.config.audit
                out[audit & (out == Decision.ABANDON)] = Decision.CONTINUE
            return out
        abandon = units.p_eff < self.config.tau_low
        if self.prior_kind != "constant":
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


def _has_key(prompts: Sequence[Any], key: str, probes: int = 64) -> bool:
    """Whether prompts carry ``key``, judged on up to ``probes`` evenly spaced ones (simulated pools are lazy and can
    hold millions)."""
    at = np.unique(np.linspace(0, len(prompts) - 1, min(probes, len(prompts))).astype(np.int64)) if len(prompts) else []
    return any(key in (getattr(prompts[int(i)], "metadata", None) or {}) for i in at)
