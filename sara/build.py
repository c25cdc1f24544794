"""A run's allocation built whole: the allocator and the prompt sampler, each given at construction what it reads.

``choose_allocation(allocator, sampler, k=)`` reads both specs (``sara.allocators.choose_allocator``,
``sara.samplers.choose_sampler``: the classes they name, their options validated, nothing built), which a training
config does when it is made (``TrainConfig.allocation``). ``build_allocation(allocator, sampler, k=, prompts=)`` is the
one place where the two are built, in this order:

1. the allocator's choice, made from its spec unless given (its options validated, nothing built yet);
2. the population prior it fits is built from the pool (``SARAAllocator.population_for``: one grid mixture per
   prompt group under ``group_by``, from the prompts' metadata, their features or ``embed()``, the policy's
   representation of each prompt);
3. the sampler is built, given that population when it is split by prompt group and the sampler scores under one
   (``PromptSampler.takes_population``: the predictive sampler, ``population=allocator``), so prompts never drawn
   are scored by what their group showed (on one population the sampler keeps its own prior, which measured better);
4. the allocator is built, given the population and, when its spec left ``prior`` unset
   (``SARABase.reads_history``), the sampler's per-prompt history (``HistorySource``: ``sara@predictive`` is SARA
   whose prior for each prompt is the sampler's posterior).

Nothing is handed over after construction: the allocator and the sampler share the population object (the allocator
fits it, the sampler reads it) and the history object (the sampler updates it, the allocator reads it) from the
moment they exist.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from sara.allocators import AllocatorChoice, BudgetAllocator, choose_allocator
from sara.allocators.sara import PriorOptions, SARAAllocator, SARABase, SARAConfig
from sara.config import ConfigError
from sara.priors.base import GroupedPopulation
from sara.priors.history import HistorySource
from sara.samplers import PromptSampler, SamplerChoice, choose_sampler, make_sampler
from sara.types import Prompt

__all__ = ["Allocation", "AllocationChoice", "build_allocation", "choose_allocation"]


class AllocationChoice(NamedTuple):
    """A run's allocator and prompt sampler as chosen, validated and not yet built (``choose_allocation``)."""

    allocator: AllocatorChoice
    """The allocator's class and validated options."""
    sampler: SamplerChoice
    """The sampler's class and validated options."""


def choose_allocation(allocator: str | AllocatorChoice, sampler: str | SamplerChoice, *, k: int) -> AllocationChoice:
    """Both specs read and validated with the run's ``k`` (nothing built, no pool needed).

    Raises:
        ConfigError: an invalid spec (naming the field) or a ``k`` that disagrees with the run's.
    """
    return AllocationChoice(choose_allocator(allocator, k=k), choose_sampler(sampler, k=k))


class Allocation(NamedTuple):
    """A run's allocator and prompt sampler, built together (``build_allocation``; unpacks as the pair)."""

    allocator: BudgetAllocator
    """The allocator, whole."""
    sampler: PromptSampler
    """The prompt sampler, whole."""


def build_allocation(allocator: str | AllocatorChoice, sampler: str | SamplerChoice | PromptSampler, *, k: int, prompts: Sequence[Prompt] | None = None,
                     pool_size: int | None = None, seed: int = 0,
                     embed: Callable[[], np.ndarray] | None = None) -> Allocation:
    """Build the allocator and the prompt sampler of a run (the module docstring has the order).

    Args:
        allocator: The allocator's spec (``"sara"``, ``"sara:group_by=band"``, ``"module:Class:key=value"``) or its
            choice (``TrainConfig.allocation.allocator``).
        sampler: The sampler's spec (``"uniform"``, ``"predictive:explore=0.1"``) or choice, or a sampler built elsewhere
            (then it is given no population; its history is still read).
        k: The run's group size, the one source of ``k`` for both.
        prompts: The pool's prompts, indexed by pool index (``env.prompts``); None when the pool is not at hand (then
            a ``group_by`` you gave is an error and the default one gives one population).
        pool_size: Prompts in the pool when ``prompts`` is None (default: a given sampler's).
        seed: The sampler's seed.
        embed: ``embed() -> [pool, D]``, the policy's representation of each prompt (``group_by=<embedding>``;
            called only then).

    Raises:
        ConfigError: an invalid spec (naming the field), a ``group_by`` the pool cannot serve, or neither ``prompts``
            nor ``pool_size``.
    """
    if prompts is not None:
        size = len(prompts)
    elif pool_size is not None:
        size = int(pool_size)
    elif isinstance(sampler, PromptSampler):
        size = sampler.pool_size
    else:
        raise ConfigError("build_allocation: give the pool's prompts (prompts=env.prompts) or its size (pool_size=)")
    chosen = choose_allocator(allocator, k=k)
    cls, config = chosen.cls, chosen.config
    population = (cls.population_for(config, prompts, embed)
                  if issubclass(cls, SARAAllocator) and isinstance(config, SARAConfig) else None)
    lent = population if isinstance(population, GroupedPopulation) else None
    smp = make_sampler(sampler, size, seed=seed, k=k, allocator_population=lent)
    if isinstance(sampler, PromptSampler) and smp.pool_size != size:
        raise ConfigError(f"build_allocation: the sampler covers {smp.pool_size} prompts and the pool has {size}")
    history = (smp.posterior if isinstance(smp, HistorySource) and issubclass(cls, SARABase)
               and isinstance(config, PriorOptions) and cls.reads_history(config) else None)
    context: dict[str, object] = {}
    if history is not None:
        context["history"] = history
    if population is not None:
        context["population"] = population
    return Allocation(cls(config, **context), smp)
