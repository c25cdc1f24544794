"""A run's allocation built whole: the allocator and the prompt sampler, each given at construction what it reads.

``build_allocation(allocator, sampler, k=, prompts=)`` is the one place where the two meet, in this order:

1. the allocator's spec is parsed and validated (``sara.allocators.allocator_config``), nothing built yet;
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

from sara.allocators import BudgetAllocator, allocator_config
from sara.allocators.sara import PriorOptions, SARAAllocator, SARABase, SARAConfig
from sara.config import ConfigError
from sara.priors.base import GroupedPopulation
from sara.priors.history import HistorySource
from sara.samplers import PromptSampler, make_sampler
from sara.types import Prompt

__all__ = ["Allocation", "build_allocation"]


class Allocation(NamedTuple):
    """A run's allocator and prompt sampler, built together (``build_allocation``; unpacks as the pair)."""

    allocator: BudgetAllocator
    """The allocator, whole."""
    sampler: PromptSampler
    """The prompt sampler, whole."""


def build_allocation(allocator: str, sampler: str | PromptSampler, *, k: int, prompts: Sequence[Prompt] | None = None,
                     pool_size: int | None = None, seed: int = 0,
                     embed: Callable[[], np.ndarray] | None = None) -> Allocation:
    """Build the allocator and the prompt sampler of a run (the module docstring has the order).

    Args:
        allocator: The allocator's spec (``"sara"``, ``"sara:group_by=band"``, ``"module:Class:key=value"``).
        sampler: The sampler's spec (``"uniform"``, ``"predictive:explore=0.1"``), or a sampler built elsewhere
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
    cls, config = allocator_config(allocator, k=k)
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
