"""Budget allocators: who gets the next rollouts, and when a prompt is committed or abandoned.

Registry: ``ALLOCATORS`` maps names to allocator classes, one rule per name. ``choose_allocator("sara", k=8)`` reads
a spec string into an ``AllocatorChoice``, the class and its options validated by the class's pydantic ``Config``
(what a user decides at its top level, research knobs under ``internals``, all given flat in a spec; an option of
another rule is an error that names the right spec); ``make_allocator`` builds one alone. ``"module:attr"`` names a
user class without registering it.

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

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from sara.allocators.base import AllocatorConfig, AllocatorInternals, BudgetAllocator, ProtocolError
from sara.allocators.effectiveness import BinaryEffectiveness, EffectivenessModel
from sara.allocators.paper import SARAPaperAllocator, SARAPaperConfig
from sara.allocators.sara import SARAAllocator, SARAConfig, SARAInternals
from sara.allocators.sequential import SequentialAllocator, SequentialConfig, SequentialInternals
from sara.allocators.uniform import DynamicSamplingAllocator, DynamicSamplingConfig, UniformAllocator
from sara.config import ConfigError, check_spec_k, validate_config
from sara.priors.posteriors import p_effective
from sara.registry import Registry, subclass_of
from sara.types import Decision
from sara.units import UnitStatus, UnitTable, UnitView

__all__ = [
    "ALLOCATORS",
    "AllocatorChoice",
    "AllocatorConfig",
    "AllocatorInternals",
    "BinaryEffectiveness",
    "BudgetAllocator",
    "Decision",
    "DynamicSamplingAllocator",
    "DynamicSamplingConfig",
    "EffectivenessModel",
    "ProtocolError",
    "SARAAllocator",
    "SARAConfig",
    "SARAInternals",
    "SARAPaperAllocator",
    "SARAPaperConfig",
    "SequentialAllocator",
    "SequentialConfig",
    "SequentialInternals",
    "UniformAllocator",
    "UnitStatus",
    "UnitTable",
    "UnitView",
    "WeighsBatch",
    "choose_allocator",
    "make_allocator",
    "p_effective",
    "register",
]

ALLOCATORS: Registry[type[BudgetAllocator]] = Registry(
    "allocator", accepts=subclass_of(BudgetAllocator), expects="a sara.allocators.BudgetAllocator subclass")
register = ALLOCATORS.register

register("uniform", UniformAllocator)
register("ds", DynamicSamplingAllocator)
register("sara", SARAAllocator)
register("sara_paper", SARAPaperAllocator)
register("bayes_optimal", "sara.allocators.bayes_optimal:BayesOptimalAllocator")
register("sara_continuous", "sara.allocators.continuous:ContinuousSARAAllocator")
register("sara_tree", "sara.allocators.tree:TreeSARAAllocator")


@runtime_checkable
class WeighsBatch(Protocol):
    """An allocator that weights the trained groups' advantages (``sara:reweight=ds``); the trainer asks it."""

    def batch_weights(self, pool_index: np.ndarray, sizes: np.ndarray) -> np.ndarray | None: ...


@dataclass(frozen=True)
class AllocatorChoice:
    """The allocator a spec names, its options validated: what a run builds, before anything is built.

    The registry is open (``"module:Class"`` names a user's class), so the choice is the pair the registry resolves:
    the class, and its own ``Config`` validated; ``cls.Config`` is the config's type.

    Attributes:
        spec: The spec string it was chosen from (what a config file or ``--allocators`` writes).
        cls: The allocator class the spec names.
        config: Its options, validated by ``cls.Config``, ``k`` the run's.
    """

    spec: str
    cls: type[BudgetAllocator]
    config: AllocatorConfig

    @property
    def name(self) -> str:
        """The rule's registered name (``"sara"``)."""
        return self.cls.name


def choose_allocator(spec: str | AllocatorChoice, *, k: int | None = None, **defaults: object) -> AllocatorChoice:
    """The one place a spec string ``"name"`` / ``"name:key=value,..."`` / ``"module:Class:key=value"`` is read:
    the class it names and its validated options (``sara.build`` builds from them; nothing is built here).

    Args:
        spec: The spec, or a choice made earlier (returned as it is after the ``k`` check).
        k: The run's group size (the one source of ``k``); a spec that sets another ``k`` is an error.
        **defaults: Options applied before the spec's own. Options the class's config does not know are dropped from
            ``defaults`` (not from the spec, where they are an error).

    Raises:
        ConfigError: unknown allocator, invalid option (the message names the field), an option of another rule (the
            message names the right spec), or a ``k`` that disagrees with the run's.
    """
    if isinstance(spec, AllocatorChoice):
        if k is not None and spec.config.k != int(k):
            raise ConfigError(f"allocator {spec.name!r}: field 'k': {spec.config.k} disagrees with the run's k={k}")
        if defaults:
            raise ConfigError(f"allocator {spec.name!r}: options go into the spec, not beside a choice already made")
        return spec
    cls, options = ALLOCATORS.from_spec(spec)
    if not (isinstance(cls, type) and issubclass(cls, BudgetAllocator)):
        raise ConfigError(f"{spec!r} does not name a BudgetAllocator subclass")
    if k is not None:
        check_spec_k(spec, options, k, what="allocator")
        defaults["k"] = int(k)
    known = cls.Config.option_names()  # flat, as a spec gives them (internals included)
    merged: dict[str, object] = {key: v for key, v in defaults.items() if key in known}
    merged.update(options)
    return AllocatorChoice(str(spec).strip(), cls, validate_config(cls.Config, merged, what=f"allocator {cls.name!r}"))


def make_allocator(spec: str | AllocatorChoice | BudgetAllocator, *, k: int | None = None,
                   **defaults: object) -> BudgetAllocator:
    """Build an allocator from a spec string (``choose_allocator``) on its own: no sampler's history, one population
    (``sara.build.build_allocation`` builds one with the pool and the sampler it runs with).

    Args:
        spec: The spec, or a choice made earlier (an allocator instance is returned unchanged, after the ``k``
            check).
        k: The run's group size (the one source of ``k``); a spec that sets another ``k`` is an error.
        **defaults: Options applied before the spec's own (see ``choose_allocator``).

    Raises:
        ConfigError: as ``choose_allocator``, and a spec whose options need the pool (``sara:group_by=KEY``).
    """
    if isinstance(spec, BudgetAllocator):
        if k is not None and spec.k != int(k):
            raise ConfigError(f"allocator {spec.name!r}: field 'k': {spec.k} disagrees with the run's k={k}")
        return spec
    choice = choose_allocator(spec, k=k, **defaults)
    return choice.cls(choice.config)
