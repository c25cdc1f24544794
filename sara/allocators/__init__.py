"""Budget allocators: who gets the next rollouts, and when a prompt is committed or abandoned.

Registry: ``ALLOCATORS`` maps names to allocator classes; ``make_allocator("sara:tau_low=0.45,probe=1", k=8)``
builds one from a spec string (options validated by the class's pydantic ``Config``). ``"module:attr"`` names a user
class without registering it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sara.allocators.base import (
    AllocatorConfig,
    BinaryEffectiveness,
    BudgetAllocator,
    ConstantPrior,
    EffectivenessModel,
    Prior,
)
from sara.allocators.posteriors import p_effective
from sara.allocators.samplers import SAMPLERS, PromptSampler, UniformSampler, make_sampler
from sara.allocators.sara import SARAAllocator, SARAConfig
from sara.allocators.sequential import SequentialAllocator, SequentialConfig
from sara.allocators.uniform import DynamicSamplingAllocator, DynamicSamplingConfig, UniformAllocator
from sara.allocators.units import UnitStatus, UnitTable, UnitView
from sara.config import ConfigError
from sara.registry import Registry
from sara.types import Decision

__all__ = [
    "ALLOCATORS",
    "AllocatorConfig",
    "BinaryEffectiveness",
    "BudgetAllocator",
    "ConstantPrior",
    "Decision",
    "DynamicSamplingAllocator",
    "DynamicSamplingConfig",
    "EffectivenessModel",
    "Prior",
    "PromptSampler",
    "SAMPLERS",
    "SARAAllocator",
    "SARAConfig",
    "SequentialAllocator",
    "SequentialConfig",
    "UniformAllocator",
    "UniformSampler",
    "UnitStatus",
    "UnitTable",
    "UnitView",
    "compose",
    "make_allocator",
    "make_sampler",
    "p_effective",
    "register",
]

ALLOCATORS: Registry[type[BudgetAllocator]] = Registry("allocator")
register = ALLOCATORS.register

register("uniform", UniformAllocator)
register("ds", DynamicSamplingAllocator)
register("sara", SARAAllocator)
# Beyond the paper (issue 5); lazy entry points, imported on first use.
register("bayes_optimal", "sara.allocators.bayes_optimal:BayesOptimalAllocator")
register("sara_continuous", "sara.allocators.continuous:ContinuousSARAAllocator")
register("sara_async", "sara.allocators.async_:AsyncSARAAllocator")
register("sara_tree", "sara.allocators.tree:TreeSARAAllocator")
SAMPLERS.register("predictive", "sara.allocators.predictive:PredictiveSampler")


def make_allocator(spec: str | BudgetAllocator, **defaults: Any) -> BudgetAllocator:
    """Build an allocator from a spec string ``"name"`` / ``"name:key=value,..."`` / ``"module:Class:key=value"``.

    Args:
        spec: The spec (an allocator instance is returned unchanged).
        **defaults: Options applied before the spec's own (e.g. ``k=8`` from the command line). Options the class's
            config does not know are dropped from ``defaults`` (not from the spec, where they are an error).

    Raises:
        ConfigError: unknown allocator or invalid option; the message names the field.
    """
    if isinstance(spec, BudgetAllocator):
        return spec
    cls, options = ALLOCATORS.from_spec(spec)
    if not (isinstance(cls, type) and issubclass(cls, BudgetAllocator)):
        raise ConfigError(f"{spec!r} does not name a BudgetAllocator subclass")
    known = cls.Config.model_fields
    merged = {k: v for k, v in defaults.items() if k in known}
    merged.update(options)
    return cls(merged)


def compose(allocator: BudgetAllocator, sampler: PromptSampler,
            prompts: Sequence[Any] | None = None) -> tuple[BudgetAllocator, PromptSampler]:
    """Wire an allocator to the sampler it runs with: the one place where the two are composed.

    A sampler that keeps per-prompt posteriors (``posterior``, a ``HistoryPrior``: the predictive sampler) lends them
    to an allocator that can use them (``borrow_history``: ``sara``) unless the allocator's spec set ``prior``. So
    ``allocator=sara`` with ``sampler=predictive`` is SARA + predictive selection, each prompt's prior being the
    sampler's history; ``sara:prior=constant`` with the same sampler keeps its own prior.

    With the pool's ``prompts`` (indexed by pool index), an allocator that splits its population prior by a prompt
    feature (``group_prompts``: ``sara:group_by=KEY``) gets them.

    Returns:
        ``(allocator, sampler)``, the same objects (the allocator's prior possibly replaced).
    """
    from sara.allocators.priors import HistoryPrior

    history = getattr(sampler, "posterior", None)
    borrow = getattr(allocator, "borrow_history", None)
    if isinstance(history, HistoryPrior) and borrow is not None:
        borrow(history)
    group = getattr(allocator, "group_prompts", None)
    if group is not None and prompts is not None:
        group(prompts)
    elif getattr(allocator, "group_by_given", False):
        raise ConfigError(f"{getattr(allocator, 'name', 'allocator')}: field 'group_by' needs the pool's prompts: "
                          "call compose(allocator, sampler, prompts=env.prompts)")
    return allocator, sampler
