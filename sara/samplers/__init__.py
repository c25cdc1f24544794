"""Prompt samplers: which prompts are drawn (uniform, predictive); the ``SAMPLERS`` registry and ``make_sampler``.

Samplers use the priors (``sara.priors``): the predictive sampler keeps a per-prompt ``HistoryPrior`` that an allocator
may read, and may score prompts under the population an allocator fits; ``sara.build.build_allocation`` builds the
population first and gives each component what it reads at construction. Samplers never import allocators.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sara.config import ConfigError, check_spec_k
from sara.registry import Registry, subclass_of
from sara.samplers.base import PromptSampler, UniformSampler, UniformSamplerConfig

if TYPE_CHECKING:
    from sara.priors.grid import GridPrior

__all__ = ["SAMPLERS", "PromptSampler", "UniformSampler", "UniformSamplerConfig", "make_sampler"]

SAMPLERS: Registry[type[PromptSampler]] = Registry(
    "prompt sampler", accepts=subclass_of(PromptSampler), expects="a sara.samplers.PromptSampler subclass")
SAMPLERS.register("uniform", UniformSampler)
SAMPLERS.register("predictive", "sara.samplers.predictive:PredictiveSampler")


def make_sampler(spec: str | PromptSampler, pool_size: int, *, seed: int = 0, k: int | None = None,
                 allocator_population: GridPrior | None = None) -> PromptSampler:
    """Build a sampler from ``"name"`` / ``"name:key=value,..."`` for a pool of ``pool_size`` prompts.

    ``k`` (the run's group size) is passed to samplers that score groups (``takes_k``); a spec that sets another
    ``k`` is an error (the group size has one source: the training config). ``allocator_population`` (an allocator's
    grid population split by prompt group) is passed to samplers that score under one (``takes_population``).

    Raises:
        ConfigError: unknown sampler, invalid option, or a ``k`` that disagrees with the run's.
    """
    if isinstance(spec, PromptSampler):
        return spec
    cls, options = SAMPLERS.from_spec(spec)
    if not (isinstance(cls, type) and issubclass(cls, PromptSampler)):
        raise ConfigError(f"sampler {spec!r} does not name a PromptSampler subclass")
    kwargs: dict[str, object] = dict(options)
    if k is not None and cls.takes_k:
        check_spec_k(spec, options, k, what="sampler")
        kwargs["k"] = int(k)
    if allocator_population is not None and cls.takes_population:
        kwargs["allocator_population"] = allocator_population
    try:
        return cls(pool_size, seed=seed, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"sampler {spec!r}: {exc}") from None
