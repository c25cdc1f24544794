"""``sara``: Sequential Adaptive Rollout Allocation with the cost-optimal stopping rule (the recommended allocator).

Probe one rollout at a time, commit a mixed prefix and fill it to k, and abandon an unmixed prefix exactly when
finishing it costs more rollouts per expected effective group than the step achieves on average, under a population
prior fitted online (a mixture over a grid of success rates, ``sara.priors.grid``; the rule in
``sara.allocators.optimal``). It minimizes expected rollouts per effective group under the fitted population, so it
is never worse than DS there (on a mostly-mixed population it never abandons and IS DS). The paper's fixed-threshold
rule is a separate name, ``sara_paper`` (``sara.allocators.paper``).

With a predictive sampler, ``sara.build.build_allocation`` gives the sampler's per-prompt history to an allocator
whose spec does not set ``prior`` (SARA + predictive selection in one switch); with the pool's prompts, it builds the
population prior split by ``group_by`` (``SARAAllocator.population_for``) before either component and gives it to
both, so prompts never drawn are selected by their group.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeVar, cast

import numpy as np
from pydantic import Field, field_validator, model_validator

from sara.allocators.optimal import RuleCache, drain_decisions, optimal_decisions
from sara.allocators.sequential import SequentialAllocator, SequentialConfig, SequentialInternals
from sara.config import ConfigError
from sara.priors.base import GroupedPopulation, Prior, Reweight, population_of
from sara.priors.features import EMBEDDING
from sara.priors.grid import GridPrior
from sara.priors.history import DEFAULT_DECAY, BorrowedHistory, Decay, HistoryPrior
from sara.seeding import derive_seeds, uniform_from_seeds
from sara.types import Decision, Prompt
from sara.units import UnitView

__all__ = ["PriorInternals", "PriorOptions", "SARAAllocator", "SARABase", "SARAConfig", "SARAInternals",
           "reject_rule_option"]

PriorKind = Literal["constant", "empirical", "history"]
AUTO = "auto"
"""``group_by=auto``: the split is learned from the prompts' features (``sara.priors.features``)."""
_T = TypeVar("_T")


class PriorInternals(SequentialInternals):
    """Internals of a SARA rule's prior: the history prior's constants (beside the template's)."""

    decay: Decay = DEFAULT_DECAY
    """History prior only: weight of evidence per step of age (lambda in MoPPS, in (0, 1]; 1 = never forget), or
    "auto" (the default, ``sara.priors.history.DEFAULT_DECAY``): chosen online by how well each candidate predicts
    revisits."""
    max_evidence: float = Field(64.0, gt=0.0)
    """History prior only: cap on a prompt's decayed pseudo-count, so stale evidence cannot outweigh what the running
    step sees when the policy has moved (lower under fast drift)."""


class PriorOptions(SequentialConfig):
    """Where a SARA rule's prior comes from (options shared by ``sara`` and ``sara_paper``)."""

    internals: PriorInternals = Field(default_factory=PriorInternals)
    """Research knobs and constants (``PriorInternals``); a spec gives them flat (``decay=0.9``)."""
    prior: PriorKind | None = None
    """'constant' (Beta(alpha0, beta0)), 'empirical' (fitted online to the population seen so far), 'history' (each
    prompt's own posterior from earlier steps, decayed by ``decay`` per step, over the empirical base). None: the
    rule's default, or, with a predictive sampler, the sampler's history (``sara.build.build_allocation``)."""


def reject_rule_option(data: _T, name: str) -> _T:
    """A ``rule=`` option is an error: the registered name is the rule."""
    if isinstance(data, Mapping) and "rule" in data:
        raise ValueError(f"allocator {name!r}: field 'rule': the name is the rule ('sara' = the optimal rule, "
                         "'sara_paper' = the paper's fixed thresholds tau_low / tau_high); drop rule= and use the "
                         "name of the rule you want")
    return data


class SARAInternals(PriorInternals):
    """Internals of ``sara``: the audit share and seed, the reweighting cap and draining (beside the prior's)."""

    audit: float = Field(0.04, ge=0.0, le=1.0)
    """Share of units never abandoned (chosen by a hash of step and prompt, seeded by ``audit_seed``). Their complete
    groups keep the population fit identifiable: from prefixes cut after one failure alone, p = 0 and p = 0.1 look
    alike, the fit drifts toward the latter and the rule swings to abandoning nothing for a step. They cost DS's
    price per group (what that costs: docs/results.md, "Allocation rules in training")."""
    audit_seed: int = Field(0, ge=0)
    """Seed of the audit draw."""
    max_weight: float = Field(2.0, ge=1.0)
    """'ds' reweighting: cap on a rollout's weight relative to the batch mean (bounds the gradient's variance)."""
    drain: bool = True
    """Once the step's target is covered, finish the units still probing whose remaining rollouts buy effective
    groups below the optimum (True), or discard them (False). Draining lowers rollouts per effective group, but every
    drained group that mixes is surplus over the target: a larger batch, not another step."""


class SARAConfig(PriorOptions):
    """Options of ``sara`` (the optimal rule; its default prior is 'empirical')."""

    other_rules: ClassVar[Mapping[str, str]] = {"tau_low": "sara_paper", "tau_high": "sara_paper"}
    internals: SARAInternals = Field(default_factory=SARAInternals)
    """Research knobs and constants (``SARAInternals``); a spec gives them flat (``sara:audit=0``)."""
    group_by: str | None = "component|<embedding>"
    """Where the population prior's groups come from (one grid mixture per group, shrunk toward the pooled fit, one
    optimum across them; ``sara.priors.grouped``): a ``Prompt.metadata`` key whose values are the groups, e.g.
    ``component`` (``sara/Mixture-v0``), ``digits`` (``sara/Arithmetic-v0``), ``level`` (MATH); ``auto``, the feature
    learned online (every metadata key and the prompt length, chosen by prequential likelihood;
    ``sara.priors.features``); ``<embedding>``, six bands of a success rate predicted from the policy's own
    representation of each prompt (its mean final hidden state, computed once for the pool at the start by the tiny
    or HF backend, or by the trainer's policy under another backend; the regression refitted on every step's outcomes;
    ``sara.priors.representation``); or several joined by ``|``, tried in order, the first the pool carries winning
    (``auto`` always applies, so it can only come last: ``component|auto``). The default, ``component|<embedding>``,
    groups a mixture by its components and any other pool by the representation's bands where the run has one (the
    trainer on the tiny and HF backends, and on others through its policy); where it has neither (the simulator, the
    benches, the TRL and verl integrations) the pool is one population. Keys you give must exist: a list none of
    whose keys the pool carries is an error. Needs the pool's prompts, which ``sara.build.build_allocation(...,
    prompts=)`` hands over (the trainer and the benches do). None: one population."""
    reweight: Reweight | None = None
    """'ds': scale each trained group's advantages so the batch has DS's expected composition over the prior's
    groups (``GroupedGridPrior.composition_weights``; rows normalized to mean 1, capped at ``max_weight``). The rule
    abandons a hard group's prompts early and fills the batch with groups that mix cheaply, so a hard group gets
    less gradient than under DS; weighted back, learning follows DS's composition: better where the policy is about
    to learn that group, worse where it is out of reach (docs/allocation.md; measured in docs/results.md). Needs groups (``group_by``); on one
    population nothing is reweighted. The rollouts are the rule's either way. None (the default): the prior's own
    default (``GroupedPopulation.default_reweight``): 'ds' for the representation's bands (``<embedding>``), which
    follow what mixes cheaply now and so would starve a band the policy is about to learn; 'none' for a metadata key
    and ``auto``."""

    @model_validator(mode="before")
    @classmethod
    def _no_rule_option(cls, data: Any) -> Any:
        return reject_rule_option(data, "sara")

    @field_validator("group_by", mode="before")
    @classmethod
    def _keys(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        if v.strip().lower() in ("", "none"):
            return None  # spec strings: group_by=none
        keys = [key.strip() for key in v.split("|")]
        if any(not key or key.lower() == "none" for key in keys):
            raise ValueError(f"{v!r} has an empty or 'none' entry; give keys joined by '|' (e.g. 'level|auto'), or "
                             "'none' alone for one population")
        if AUTO in keys[:-1]:
            raise ValueError(f"{v!r}: 'auto' always applies, so keys after it are never used; put it last")
        return "|".join(keys)

    @property
    def group_by_given(self) -> bool:
        """Whether the spec set ``group_by`` to a key (then the pool's prompts are required)."""
        return "group_by" in self.model_fields_set and self.group_by is not None

    @property
    def group_keys(self) -> tuple[str, ...]:
        """The ``group_by`` candidates in order (empty: one population)."""
        return tuple(self.group_by.split("|")) if self.group_by else ()


class SARABase(SequentialAllocator):
    """The prior handling both SARA rules share: a prior of ``prior`` kind (``make_prior``), or a sampler's
    per-prompt history given at construction (``history``; ``sara.build.build_allocation`` gives it).

    Args:
        config: The rule's options.
        prior: A prior to use as it is (tests, experiments); None builds the one the options name.
        history: A sampler's per-prompt posteriors to read as the prior (over ``population_prior()``), given only
            when ``reads_history(config)``: the spec left ``prior`` unset.
    """

    config: PriorOptions
    default_prior: ClassVar[PriorKind] = "empirical"

    def __init__(self, config: PriorOptions | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 history: HistoryPrior | None = None, **overrides: object) -> None:
        super().__init__(config, prior=prior, **overrides)
        self.prior_kind: PriorKind = self.config.prior or self.default_prior
        if history is not None and not self.reads_history(self.config):
            raise ConfigError(f"{self.name}: field 'prior': {self.config.prior!r} is this rule's own prior, so it "
                              "reads no sampler's history; drop prior= from the spec to read the sampler's")
        if prior is None:
            if history is not None:
                self.prior = BorrowedHistory(history, self.population_prior())
                self.prior_kind = "history"
            else:
                self.prior = self.make_prior(self.prior_kind)

    @classmethod
    def reads_history(cls, config: PriorOptions) -> bool:
        """Whether a rule with ``config`` reads a sampler's per-prompt history as its prior when the run has one:
        when the spec left ``prior`` unset."""
        return config.prior is None

    @abstractmethod
    def make_prior(self, kind: PriorKind) -> Prior:
        """The rule's prior of ``kind``."""

    @abstractmethod
    def population_prior(self) -> Prior:
        """The population prior a borrowed history sits on."""


class SARAAllocator(SARABase):
    """COMMIT a mixed prefix; ABANDON when finishing costs more than the step's optimum; else CONTINUE."""

    name = "sara"
    Config = SARAConfig
    config: SARAConfig

    def __init__(self, config: SARAConfig | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 history: HistoryPrior | None = None, population: GridPrior | None = None,
                 **overrides: object) -> None:
        """Args: as ``SARABase``'s, and ``population``: the grid population prior the rule fits, split by prompt
        group (``population_for(config, prompts)``); None builds one population, which a ``group_by`` you gave
        does not allow (the pool's prompts decide the groups: ``sara.build.build_allocation`` passes them)."""
        self._given_population = population  # read by make_prior / population_prior during super().__init__
        super().__init__(config, prior=prior, history=history, **overrides)
        self._rule = RuleCache()

    @classmethod
    def population_for(cls, config: SARAConfig, prompts: Sequence[Prompt] | None,
                       embed: Callable[[], np.ndarray] | None = None) -> GridPrior:
        """The grid population prior a rule with ``config`` fits on the pool ``prompts`` (indexed by pool index):
        one mixture per group of the first ``group_by`` candidate the pool carries, else one population (also when
        ``prompts`` is None and ``group_by`` was left at its default). ``embed() -> [pool, D]``, the prompts'
        representations (``sara.envs.base.EmbedsPrompts``), is called only when ``<embedding>`` is the key chosen.

        Raises:
            ConfigError: naming ``group_by`` when a list you gave has no key the pool carries, names ``<embedding>``
                and the run has no representation of the prompts (``embed`` is None), or needs prompts and got none.
        """
        from sara.priors.grouped import GroupedGridPrior, group_labels

        inner = config.internals
        base = GridPrior(inner.alpha0, inner.beta0, fit=(config.prior or cls.default_prior) != "constant")
        keys, given = config.group_keys, config.group_by_given
        if prompts is None:
            if given:
                raise ConfigError(f"sara: field 'group_by': {config.group_by!r} splits the pool by its prompts, and "
                                  "none were given; pass the pool's prompts (sara.build.build_allocation(..., "
                                  "prompts=env.prompts)), or drop group_by for one population")
            return base

        def carried(k: str) -> bool:
            # A key you gave is looked for in every prompt; the default's in a sample (simulated pools are lazy).
            if k == EMBEDDING:
                return embed is not None
            return k == AUTO or (any(k in p.metadata for p in prompts) if given else _has_key(prompts, k))

        key = next((k for k in keys if carried(k)), None)
        if key is None and given and EMBEDDING in keys:
            raise ConfigError(f"sara: field 'group_by': {EMBEDDING} needs the policy's representation of each prompt "
                              "(sara.envs.base.EmbedsPrompts: the tiny and hf backends, or the trainer's hf / tiny "
                              "policy), and this run has none; group by a metadata key or auto instead")
        if key is None:
            if given and len(keys) > 1:
                present = sorted({k for p in prompts for k in p.metadata})
                raise ConfigError(f"sara: field 'group_by': no prompt has any of the metadata keys {list(keys)}; "
                                  f"keys present: {', '.join(present) or '(none)'}; add 'auto' or drop group_by")
            if given:
                group_labels(prompts, keys[0])  # raises, naming the key and the keys present
            return base  # unset, or the default on a pool without its key: one population
        if key == EMBEDDING:
            from sara.priors.representation import RepresentationPrior

            assert embed is not None  # carried() said so
            return RepresentationPrior.like(base, embed())
        if key == AUTO:
            from sara.priors.features import FeatureGroupedPrior, feature_splits

            splits = feature_splits(prompts)
            return FeatureGroupedPrior.like(base, splits) if splits else base  # no feature to split by: one
        return GroupedGridPrior.like(base, *group_labels(prompts, key))

    def make_prior(self, kind: PriorKind) -> Prior:
        """The grid population (given, or one fitted unless 'constant'); under a per-prompt history for 'history'."""
        base = self.population_prior()
        c = self.config.internals
        return HistoryPrior(c.decay, base, max_evidence=c.max_evidence) if kind == "history" else base

    def population_prior(self) -> GridPrior:
        """The population the rule fits: the one given at construction, else ``population_for`` without the pool
        (one population; a ``group_by`` you gave is an error there)."""
        if self._given_population is not None:
            return self._given_population
        return self.population_for(self.config, None)

    def batch_weights(self, pool_index: np.ndarray, sizes: np.ndarray) -> np.ndarray | None:
        """``[rows]`` advantage weights of a batch of groups (their pool indices and sizes, rows in group order) when
        ``reweight`` resolves to 'ds'; None when nothing is reweighted ('none', or a population without groups)."""
        base = population_of(self.prior)
        if not isinstance(base, GroupedPopulation) or not len(sizes):
            return None
        if (self.config.reweight or base.default_reweight) == "none":
            return None
        w = np.repeat(base.composition_weights(self.k)[base.unit_groups(np.asarray(pool_index, np.int64))], sizes)
        w = np.minimum(w / w.mean(), self.config.internals.max_weight)
        return cast(np.ndarray, w / w.mean())

    def _population(self) -> GridPrior:
        return cast(GridPrior, population_of(self.prior))  # the rule reads a grid (make_prior builds one)

    def drain(self, units: UnitView) -> np.ndarray:
        """Finish the units in flight whose remaining rollouts buy effective groups below the optimum."""
        if not self.config.internals.drain or not len(units.ids):
            return super().drain(units)
        base = self._population()
        return drain_decisions(base, units, self._rule.tables(base, self.k)[0])

    def decide(self, units: UnitView) -> np.ndarray:
        self.prior.refresh(units.table)
        base = self._population()
        out = optimal_decisions(base, units, self._rule.tables(base, self.k))
        inner = self.config.internals
        if inner.audit > 0:
            pool = units.table.pool_index[units.ids]
            audit = uniform_from_seeds(derive_seeds(inner.audit_seed, self.step, pool)) < inner.audit
            out[audit & (out == Decision.ABANDON)] = Decision.CONTINUE
        return out


def _has_key(prompts: Sequence[Prompt], key: str, probes: int = 64) -> bool:
    """Whether prompts carry ``key``, judged on up to ``probes`` evenly spaced ones (simulated pools are lazy and can
    hold millions)."""
    at: np.ndarray | list[int] = (
        np.unique(np.linspace(0, len(prompts) - 1, min(probes, len(prompts))).astype(np.int64))
        if len(prompts) else [])
    return any(key in prompts[int(i)].metadata for i in at)
