"""What a run's allocator and prompt sampler resolve to, before the pool or the model is loaded; and the config as
``sara train --print-config`` prints it.

``build_run_allocation(cfg, prompts, embed)`` is how the trainer builds both from a ``TrainConfig``'s typed choice,
``cfg.allocation`` (``sara.build.build_allocation``: the classes the specs name, their options validated by each
class's config with ``k`` from the run; each component given at construction what it reads).
``resolved_allocation(cfg)`` reads the same choice (the sampler built over a one-prompt pool: no option depends on the
pool's size; nothing here loads a task or a model), decides what reads what by the builder's rules, and reads every
option back, with each ``auto`` / None default replaced by what it resolves to. What only the pool or the model
decides (``group_by``'s key, the population a predictive sampler scores under) is named by what it is derived from.

``config_yaml(cfg)`` is ``--print-config``'s YAML: every field of the config (loading it back gives the same
``TrainConfig``: the allocator and the sampler stay spec strings), the resolved allocator and sampler as comments
under their specs (the allocator's user options, then its ``internals`` as an indented block), and the ``ray``
section only when ``ray.enabled`` (its options mean nothing while it is off).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from sara.allocators import AllocatorConfig, BudgetAllocator
from sara.allocators.sara import AUTO, PriorOptions, SARAAllocator, SARABase, SARAConfig
from sara.allocators.sequential import SequentialConfig
from sara.allocators.uniform import DynamicSamplingConfig
from sara.build import Allocation, build_allocation
from sara.configfile import dump_yaml
from sara.priors.features import EMBEDDING, FeatureGroupedPrior
from sara.priors.grouped import GroupedGridPrior
from sara.priors.history import AUTO_DECAYS, HistorySource
from sara.priors.representation import RepresentationPrior
from sara.samplers import SamplerChoice, UniformSamplerConfig, make_sampler
from sara.samplers.predictive import PredictiveSamplerConfig
from sara.types import Prompt

if TYPE_CHECKING:
    from sara.train.config import TrainConfig

__all__ = ["allocation_config", "build_run_allocation", "config_yaml", "resolved_allocation"]

OVERSAMPLE_RULE = "fresh units until the expected commits of the units in flight cover the groups still needed"
"""What ``oversample=auto`` does each round (``sara.allocators.admission``)."""
AUTO_DECAY = f"chosen online among {', '.join(map(str, AUTO_DECAYS))} by how well each predicts revisits"
"""What ``decay=auto`` does (``sara.priors.history.HistoryPrior``)."""


def allocation_config(cfg: TrainConfig) -> AllocatorConfig:
    """The run's allocator options, validated, with the run's ``k`` (nothing built: the environment is built first,
    for the pool the allocator needs).

    Raises:
        ConfigError: an unknown allocator or an invalid option, naming the field.
    """
    return cfg.allocation.allocator.config


def build_run_allocation(cfg: TrainConfig, prompts: Sequence[Prompt],
                         embed: Callable[[], np.ndarray] | None = None) -> Allocation:
    """The run's allocator and prompt sampler on the pool ``prompts``, seeded by the run, with the run's ``k``
    (``sara.build.build_allocation``; ``embed`` is the policy's representation of each prompt).

    Raises:
        ConfigError: an invalid spec, or a ``group_by`` the pool cannot serve.
    """
    chosen = cfg.allocation
    return build_allocation(chosen.allocator, chosen.sampler, k=cfg.k, prompts=prompts, seed=cfg.seed, embed=embed)


def resolved_allocation(cfg: TrainConfig) -> dict[str, dict[str, object]]:
    """``{"allocator": {...}, "sampler": {...}}``: each one's ``name`` and every option, as the run builds it (the
    allocator's user options, then ``internals``: a mapping of its internals' options).

    An option the run uses as it is keeps its value. An ``auto`` value, a ``group_by`` list and an option that the
    resolved prior leaves unused become ``"<value> (what it resolves to, or why it is unused)"``; a None default
    becomes ``"<what it resolves to> (why)"`` (``"empirical (the rule's default)"``). Builds no model, loads no task:
    the allocator's options are read from its validated config, the sampler is built over a one-prompt pool (no
    option depends on the pool's size), and what reads what follows ``sara.build.build_allocation``'s rules.

    Raises:
        ConfigError: an invalid allocator or sampler spec, as the trainer would raise it.
    """
    chosen = cfg.allocation
    cls, config = chosen.allocator.cls, chosen.allocator.config
    sampler = make_sampler(chosen.sampler, 1, seed=cfg.seed)
    borrowed = (isinstance(sampler, HistorySource) and issubclass(cls, SARABase) and isinstance(config, PriorOptions)
                and cls.reads_history(config))
    return {"allocator": _allocator(cls, config, borrowed),
            "sampler": _sampler(chosen.sampler, cls, config)}


def _allocator(cls: type[BudgetAllocator], c: AllocatorConfig, borrowed: bool) -> dict[str, object]:
    """The user's options first, then ``internals``: a mapping of the internals' options, resolved alike."""
    dumped = c.model_dump(mode="json")
    inner: dict[str, object] = dumped.pop("internals")
    out: dict[str, object] = {"name": cls.name, **dumped}
    if isinstance(c, SequentialConfig) and c.oversample == "auto":
        out["oversample"] = f"auto ({OVERSAMPLE_RULE})"
    if isinstance(c, PriorOptions) and issubclass(cls, SARABase):
        kind = c.prior or cls.default_prior
        if borrowed:
            out["prior"] = "history (the sampler's per-prompt history, over a fitted population)"
        elif c.prior is None:
            out["prior"] = f"{kind} (the rule's default)"
        if borrowed or kind != "history":
            why = "the prior is the sampler's history, with its options" if borrowed else f"the prior is {kind}"
            inner.update({key: f"{inner[key]} (unused, {why})" for key in ("decay", "max_evidence")})
        elif c.internals.decay == "auto":
            inner["decay"] = f"auto ({AUTO_DECAY})"
    if isinstance(c, SARAConfig):
        out["group_by"] = _group_by(c, given=c.group_by_given)
        if c.reweight is None:
            out["reweight"] = _reweight(c)
    if isinstance(c, DynamicSamplingConfig):
        if c.gen_batch_prompts is None:
            out["gen_batch_prompts"] = "per batch (ceil(groups still needed / the effective fraction))"
        if c.expected_effective is None:
            out["expected_effective"] = ("per batch (the step's committed share of its finished groups, 1.0 before "
                                         "any, at least 1 / max_oversample)")
    out["internals"] = inner
    return out


def _group_by(c: SARAConfig, *, given: bool) -> str:
    if not c.group_keys:
        return "none (one population)"
    where = {EMBEDDING: "by the policy's representation of each prompt if the run has one",
             AUTO: "by a prompt feature learned online"}
    ways = [where.get(key, f"by the metadata key {key} if the pool's prompts carry it") for key in c.group_keys]
    if c.group_keys[-1] != AUTO:  # auto always applies
        ways.append("an error" if given else "one population")
    return f"{c.group_by} ({', else '.join(ways)})"


def _reweight(c: SARAConfig) -> str:
    """What ``reweight=None`` resolves to: the default of the grouped prior each ``group_by`` key builds."""
    builds = {EMBEDDING: RepresentationPrior.default_reweight, AUTO: FeatureGroupedPrior.default_reweight}
    by_key = {key: builds.get(key, GroupedGridPrior.default_reweight) for key in c.group_keys}
    if not by_key:
        return "none (one population, nothing to reweight)"
    if len(set(by_key.values())) == 1:
        return f"{next(iter(by_key.values()))} (the grouped prior's default; none on one population)"
    each = ", ".join(f"{value} under {key}" for key, value in by_key.items())
    return f"{each} (the grouped prior's default, by the group_by key the pool carries; none on one population)"


def _sampler(choice: SamplerChoice, cls: type[BudgetAllocator], allocator: AllocatorConfig) -> dict[str, object]:
    config = choice.config  # None: a sampler class without a Config (its options as the spec wrote them)
    if config is None:
        return {"name": choice.name, **choice.options}
    out: dict[str, object] = {"name": choice.name, **config.model_dump(mode="json")}
    if isinstance(config, PredictiveSamplerConfig):
        if config.decay == "auto":
            out["decay"] = f"auto ({AUTO_DECAY})"
        if config.population == "allocator":
            lends = (issubclass(cls, SARAAllocator) and isinstance(allocator, SARAConfig)
                     and bool(allocator.group_keys))  # a population split by prompt group (sara.build)
            out["population"] = (
                f"allocator ({cls.name}'s grid population, split by its prompt groups, where its group_by "
                "splits the pool; else the sampler's own Beta)" if lends
                else f"allocator (the sampler's own Beta, {cls.name} lends no population)")
    if isinstance(config, UniformSamplerConfig) and config.pool_epochs is None:
        out["pool_epochs"] = "unlimited (null)"
    return out


def config_yaml(cfg: TrainConfig) -> str:
    """``sara train --print-config``: ``cfg`` as YAML that loads back as the same run (``sara train --config``),
    with ``resolved_allocation`` as comments under the ``allocator`` and ``sampler`` specs and no ``ray`` section
    while Ray is off.

    Raises:
        ConfigError: an invalid allocator or sampler spec.
    """
    data = cfg.model_dump(mode="json")
    if not cfg.ray.enabled:
        del data["ray"]  # an off switch: the default (off) is what loading the file back gives
    resolved = resolved_allocation(cfg)
    lines: list[str] = []
    for key, value in data.items():
        lines.append(dump_yaml({key: value}))
        if key in resolved:
            lines.append(f"#   the {key} this run builds, every option (sara.train.resolve):")
            lines += _comments(resolved[key], "#     ")
    return "\n".join(lines)


def _comments(options: dict[str, object], indent: str) -> list[str]:
    """``name: value`` comment lines; a mapping (the allocator's ``internals``) as its own block, indented."""
    lines: list[str] = []
    for name, option in options.items():
        if isinstance(option, dict):
            lines += [f"{indent}{name}:", *_comments(option, indent + "  ")]
        else:
            lines.append(f"{indent}{name}: {dump_yaml(option, one_line=True)}")
    return lines
