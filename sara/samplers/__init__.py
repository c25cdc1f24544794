"""Prompt samplers: which prompts are drawn (uniform, predictive); the ``SAMPLERS`` registry and ``make_sampler``.

Samplers use the priors (``sara.priors``): the predictive sampler keeps a per-prompt ``HistoryPrior`` that an allocator
may read, and may score prompts under the population an allocator fits; ``sara.build.build_allocation`` builds the
population first and gives each component what it reads at construction. Samplers never import allocators.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sara.config import ConfigError, SaraModel, check_spec_k, validate_config
from sara.registry import Registry, subclass_of
from sara.samplers.base import PromptSampler, UniformSampler, UniformSamplerConfig

if TYPE_CHECKING:
    from sara.priors.grid import GridPrior

__all__ = ["SAMPLERS", "PromptSampler", "SamplerChoice", "UniformSampler", "UniformSamplerConfig", "choose_sampler",
           "make_sampler"]

SAMPLERS: Registry[type[PromptSampler]] = Registry(
    "prompt sampler", accepts=subclass_of(PromptSampler), expects="a sara.samplers.PromptSampler subclass")
SAMPLERS.register("uniform", UniformSampler)
SAMPLERS.register("predictive", "sara.samplers.predictive:PredictiveSampler")


@dataclass(frozen=True)
class SamplerChoice:
    """The prompt sampler a spec names, its options validated: what a run builds, before the pool exists.

    Attributes:
        spec: The spec string it was chosen from.
        cls: The sampler class the spec names.
        config: Its options validated by ``cls.Config`` (``k`` the run's where the sampler scores groups); None for a
            class without a ``Config`` (a user's sampler), whose constructor validates ``options``.
        options: What the constructor is given besides the pool and the seed: ``config``'s fields, or the spec's own
            options as written when there is no ``Config``.
    """

    spec: str
    cls: type[PromptSampler]
    config: SaraModel | None
    options: Mapping[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The sampler's registered name (``"predictive"``)."""
        return self.cls.name


def choose_sampler(spec: str | SamplerChoice, *, k: int | None = None) -> SamplerChoice:
    """The one place a sampler spec ``"name"`` / ``"name:key=value,..."`` is read: the class it names and its
    validated options (nothing is built; the pool may not exist yet).

    ``k`` (the run's group size) is given to samplers that score groups (``takes_k``); a spec that sets another ``k``
    is an error (the group size has one source: the training config).

    Raises:
        ConfigError: unknown sampler, invalid option (naming the field), or a ``k`` that disagrees with the run's.
    """
    if isinstance(spec, SamplerChoice):
        if k is not None and spec.cls.takes_k and spec.options.get("k") != int(k):
            raise ConfigError(f"sampler {spec.name!r}: field 'k': {spec.options.get('k')} disagrees with the run's "
                              f"k={k}")
        return spec
    cls, options = SAMPLERS.from_spec(spec)
    if not (isinstance(cls, type) and issubclass(cls, PromptSampler)):
        raise ConfigError(f"sampler {spec!r} does not name a PromptSampler subclass")
    given: dict[str, object] = dict(options)
    if k is not None and cls.takes_k:
        check_spec_k(spec, options, k, what="sampler")
        given["k"] = int(k)
    if cls.Config is None:
        return SamplerChoice(str(spec).strip(), cls, None, given)
    config = validate_config(cls.Config, given, what=f"sampler {cls.name!r}")
    return SamplerChoice(str(spec).strip(), cls, config, dict(config))


def make_sampler(spec: str | SamplerChoice | PromptSampler, pool_size: int, *, seed: int = 0, k: int | None = None,
                 allocator_population: GridPrior | None = None) -> PromptSampler:
    """Build a sampler from its spec (``choose_sampler``) for a pool of ``pool_size`` prompts.

    ``allocator_population`` (an allocator's grid population split by prompt group) is passed to samplers that score
    under one (``takes_population``).

    Raises:
        ConfigError: as ``choose_sampler``, and options the constructor refuses.
    """
    if isinstance(spec, PromptSampler):
        return spec
    choice = choose_sampler(spec, k=k)
    kwargs: dict[str, object] = dict(choice.options)
    if allocator_population is not None and choice.cls.takes_population:
        kwargs["allocator_population"] = allocator_population
    try:
        return choice.cls(pool_size, seed=seed, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"sampler {choice.spec!r}: {exc}") from None
