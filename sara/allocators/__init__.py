"""Budget allocators: who gets the next rollouts, and when a prompt is committed or abandoned.

Registry: ``ALLOCATORS`` maps names to allocator classes, one rule per name; ``make_allocator("sara", k=8)`` builds
one from a spec string (options validated by the class's pydantic ``Config``; an option of another rule is an error
that names the right spec). ``"module:attr"`` names a user class without registering it.

| name | rule |
|---|---|
| ``uniform`` | k rollouts for each of the groups needed; every group to the batch |
| ``ds`` | DAPO dynamic sampling: full groups, keep the effective ones, refill |
| ``sara`` | the cost-optimal stopping rule under an online population prior (recommended) |
| ``sara_paper`` | the paper's fixed thresholds ``tau_low`` / ``tau_high`` on the Beta-Binomial p_eff |
| ``bayes_optimal`` | the DP reference for one Beta population with a cap on wrong abandons |
| ``sara_continuous`` | ``sara_paper``'s thresholds on bounded continuous rewards |
| ``sara_tree`` | ``sara_paper``'s thresholds per rollout tree, leaves placed per node |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, runtime_checkable

import numpy as np

from sara.allocators.base import AllocatorConfig, BudgetAllocator, ProtocolError
from sara.allocators.effectiveness import BinaryEffectiveness, EffectivenessModel
from sara.allocators.paper import SARAPaperAllocator, SARAPaperConfig
from sara.allocators.sara import SARAAllocator, SARAConfig
from sara.allocators.sequential import SequentialAllocator, SequentialConfig
from sara.allocators.uniform import DynamicSamplingAllocator, DynamicSamplingConfig, UniformAllocator
from sara.config import ConfigError
from sara.priors.grid import GridPrior
from sara.priors.history import HistoryPrior, HistorySource
from sara.priors.posteriors import p_effective
from sara.registry import Registry, subclass_of
from sara.types import Decision, Prompt
from sara.units import UnitStatus, UnitTable, UnitView

__all__ = [
    "ALLOCATORS",
    "AllocatorConfig",
    "BinaryEffectiveness",
    "BorrowsHistory",
    "BudgetAllocator",
    "Decision",
    "DynamicSamplingAllocator",
    "DynamicSamplingConfig",
    "EffectivenessModel",
    "GroupsPrompts",
    "LendsPopulation",
    "ProtocolError",
    "SARAAllocator",
    "SARAConfig",
    "SARAPaperAllocator",
    "SARAPaperConfig",
    "SequentialAllocator",
    "SequentialConfig",
    "TakesPopulation",
    "UniformAllocator",
    "UnitStatus",
    "UnitTable",
    "UnitView",
    "WeighsBatch",
    "compose",
    "make_allocator",
    "p_effective",
    "register",
    "share_history",
]

ALLOCATORS: Registry[type[BudgetAllocator]] = Registry(
    "allocator", accepts=subclass_of(BudgetAllocator), expects="a sara.allocators.BudgetAllocator subclass")
register = ALLOCATORS.register

_A = TypeVar("_A", bound=BudgetAllocator)
_S = TypeVar("_S")

register("uniform", UniformAllocator)
register("ds", DynamicSamplingAllocator)
register("sara", SARAAllocator)
register("sara_paper", SARAPaperAllocator)
register("bayes_optimal", "sara.allocators.bayes_optimal:BayesOptimalAllocator")
register("sara_continuous", "sara.allocators.continuous:ContinuousSARAAllocator")
register("sara_tree", "sara.allocators.tree:TreeSARAAllocator")


@runtime_checkable
class BorrowsHistory(Protocol):
    """An allocator that can read a sampler's per-prompt history as its prior (``sara``, ``sara_paper``)."""

    def borrow_history(self, history: HistoryPrior) -> bool: ...


@runtime_checkable
class GroupsPrompts(Protocol):
    """An allocator that splits its population prior by a prompt feature (``sara:group_by=KEY``)."""

    group_by_given: bool

    def group_prompts(self, prompts: Sequence[Prompt], embed: Callable[[], np.ndarray] | None = None) -> bool: ...


@runtime_checkable
class LendsPopulation(Protocol):
    """An allocator whose population prior is a grid mixture it can lend to a sampler (``sara``)."""

    def lend_population(self) -> GridPrior | None: ...


@runtime_checkable
class TakesPopulation(Protocol):
    """A sampler that can score prompts under an allocator's grid population (the predictive sampler)."""

    def use_population(self, prior: GridPrior) -> bool: ...


@runtime_checkable
class WeighsBatch(Protocol):
    """An allocator that weights the trained groups' advantages (``sara:reweight=ds``); the trainer asks it."""

    def batch_weights(self, pool_index: np.ndarray, sizes: np.ndarray) -> np.ndarray | None: ...


def make_allocator(spec: str | BudgetAllocator, *, k: int | None = None, **defaults: object) -> BudgetAllocator:
    """Build an allocator from a spec string ``"name"`` / ``"name:key=value,..."`` / ``"module:Class:key=value"``.

    Args:
        spec: The spec (an allocator instance is returned unchanged, after the ``k`` check).
        k: The run's group size (the one source of ``k``); a spec that sets another ``k`` is an error.
        **defaults: Options applied before the spec's own. Options the class's config does not know are dropped from
            ``defaults`` (not from the spec, where they are an error).

    Raises:
        ConfigError: unknown allocator, invalid option (the message names the field), an option of another rule (the
            message names the right spec), or a ``k`` that disagrees with the run's.
    """
    if isinstance(spec, BudgetAllocator):
        if k is not None and spec.k != int(k):
            raise ConfigError(f"allocator {spec.name!r}: field 'k': {spec.k} disagrees with the run's k={k}")
        return spec
    cls, options = ALLOCATORS.from_spec(spec)
    if not (isinstance(cls, type) and issubclass(cls, BudgetAllocator)):
        raise ConfigError(f"{spec!r} does not name a BudgetAllocator subclass")
    if k is not None:
        if "k" in options and options["k"].strip() != str(int(k)):
            raise ConfigError(f"allocator {spec!r}: field 'k': {options['k']} disagrees with the run's k={k}; drop k "
                              "from the allocator spec (the group size comes from the training config's k)")
        defaults["k"] = int(k)
    known = cls.Config.model_fields
    merged = {key: v for key, v in defaults.items() if key in known}
    merged.update(options)
    return cls(merged)


def share_history(allocator: BudgetAllocator, sampler: object) -> bool:
    """``compose``'s first step, which needs no pool: a sampler that keeps per-prompt posteriors (``HistorySource``)
    lends them to an allocator that can read them (``BorrowsHistory``) and whose spec left ``prior`` unset. True
    when the allocator now reads the sampler's history (``sara.train.resolve`` asks it for ``--print-config``)."""
    return (isinstance(sampler, HistorySource) and isinstance(allocator, BorrowsHistory)
            and allocator.borrow_history(sampler.posterior))


def compose(allocator: _A, sampler: _S, prompts: Sequence[Prompt] | None = None,
            embed: Callable[[], np.ndarray] | None = None) -> tuple[_A, _S]:
    """Wire an allocator to the sampler it runs with: the one place where the two are composed.

    A sampler that keeps per-prompt posteriors (``HistorySource``: the predictive sampler) lends them to an allocator
    that can use them (``BorrowsHistory``: ``sara``, ``sara_paper``) unless the allocator's spec set ``prior``. So
    ``allocator=sara`` with ``sampler=predictive`` is SARA + predictive selection, each prompt's prior being the
    sampler's history; ``sara:prior=constant`` with the same sampler keeps its own prior.

    With the pool's ``prompts`` (indexed by pool index), an allocator that splits its population prior by a prompt
    feature (``GroupsPrompts``: ``sara:group_by=KEY``) gets them, and with ``embed() -> [pool, D]`` (the backend's
    representation of the pool's prompts, ``sara.envs.task_env.pool_embedder``) it may split by that
    (``group_by=<embedding>``; called only then).

    Last, a sampler that scores prompts under a population (``TakesPopulation``: the predictive sampler) gets the
    allocator's grid population prior (``LendsPopulation``: ``sara``), split by prompt group when the allocator
    groups, so prompts never drawn are scored by what their group's closed prompts showed.

    Returns:
        ``(allocator, sampler)``, the same objects (the allocator's prior possibly replaced).
    """
    share_history(allocator, sampler)
    if isinstance(allocator, GroupsPrompts):
        if prompts is not None:
            allocator.group_prompts(prompts, embed)
        elif allocator.group_by_given:
            raise ConfigError(f"{allocator.name}: field 'group_by' needs the pool's prompts: call compose(allocator, "
                              "sampler, prompts=env.prompts)")
    if isinstance(sampler, TakesPopulation) and isinstance(allocator, LendsPopulation):
        population = allocator.lend_population()
        if population is not None:
            sampler.use_population(population)
    return allocator, sampler
