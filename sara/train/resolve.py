"""What a run's allocator and prompt sampler resolve to, before the pool or the model is loaded; and the config as
``sara train --print-config`` prints it.

``build_allocator(cfg)`` and ``build_sampler(cfg, pool_size)`` are how the trainer builds both from a ``TrainConfig``
(the spec's options validated by the class's config, ``k`` from the run). ``resolved_allocation(cfg)`` builds them
the same way (the sampler over a one-prompt pool: no option depends on the pool's size; nothing here loads a task or
a model), lends the sampler's history to the allocator as ``compose`` does (``sara.allocators.share_history``), and
reads every option back from what was built, with each ``auto`` / None default replaced by what it resolves to. What
only the pool or the model decides (``group_by``'s key, the population a predictive sampler scores under) is named
by what it is derived from.

``config_yaml(cfg)`` is ``--print-config``'s YAML: every field of the config (loading it back gives the same
``TrainConfig``: the allocator and the sampler stay spec strings), the resolved allocator and sampler as comments
under their specs, and the ``ray`` section only when ``ray.enabled`` (its options mean nothing while it is off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

from sara.allocators import BudgetAllocator, LendsPopulation, make_allocator, share_history
from sara.allocators.sara import AUTO, PriorOptions, SARABase, SARAConfig
from sara.allocators.sequential import SequentialConfig
from sara.allocators.uniform import DynamicSamplingConfig
from sara.config import parse_spec
from sara.configfile import dump_yaml
from sara.priors.features import EMBEDDING, FeatureGroupedPrior
from sara.priors.grouped import GroupedGridPrior
from sara.priors.history import AUTO_DECAYS
from sara.priors.representation import RepresentationPrior
from sara.samplers import PromptSampler, UniformSamplerConfig, make_sampler
from sara.samplers.predictive import PredictiveSamplerConfig

if TYPE_CHECKING:
    from sara.train.config import TrainConfig

__all__ = ["build_allocator", "build_sampler", "config_yaml", "resolved_allocation"]

OVERSAMPLE_RULE = "fresh units until the expected commits of the units in flight cover the groups still needed"
"""What ``oversample=auto`` does each round (``sara.allocators.admission``)."""
AUTO_DECAY = f"chosen online among {', '.join(map(str, AUTO_DECAYS))} by how well each predicts revisits"
"""What ``decay=auto`` does (``sara.priors.history.HistoryPrior``)."""


def build_allocator(cfg: TrainConfig) -> BudgetAllocator:
    """The run's allocator, from ``cfg.allocator`` with the run's ``k`` (before ``compose`` wires it to the sampler).

    Raises:
        ConfigError: an unknown allocator or an invalid option, naming the field.
    """
    return make_allocator(cfg.allocator, k=cfg.k)


def build_sampler(cfg: TrainConfig, pool_size: int) -> PromptSampler:
    """The run's prompt sampler over a pool of ``pool_size`` prompts, seeded by the run, with the run's ``k``.

    Raises:
        ConfigError: an unknown sampler or an invalid option.
    """
    return make_sampler(cfg.sampler, pool_size, seed=cfg.seed, k=cfg.k)


def resolved_allocation(cfg: TrainConfig) -> dict[str, dict[str, object]]:
    """``{"allocator": {...}, "sampler": {...}}``: each one's ``name`` and every option, as the run builds it.

    An option the run uses as it is keeps its value. An ``auto`` value, a ``group_by`` list and an option that the
    resolved prior leaves unused become ``"<value> (what it resolves to, or why it is unused)"``; a None default
    becomes ``"<what it resolves to> (why)"`` (``"empirical (the rule's default)"``). Builds no model, loads no task.

    Raises:
        ConfigError: an invalid allocator or sampler spec, as the trainer would raise it.
    """
    allocator, sampler = build_allocator(cfg), build_sampler(cfg, 1)
    borrowed = share_history(allocator, sampler)
    return {"allocator": _allocator(allocator, borrowed),
            "sampler": _sampler(sampler, allocator, parse_spec(cfg.sampler)[1])}


def _allocator(allocator: BudgetAllocator, borrowed: bool) -> dict[str, object]:
    c = allocator.config
    out: dict[str, object] = {"name": allocator.name, **c.model_dump(mode="json")}
    if isinstance(c, SequentialConfig) and c.oversample == "auto":
        out["oversample"] = f"auto ({OVERSAMPLE_RULE})"
    if isinstance(c, PriorOptions) and isinstance(allocator, SARABase):
        kind = allocator.prior_kind
        if borrowed:
            out["prior"] = "history (the sampler's per-prompt history, over a fitted population)"
        elif c.prior is None:
            out["prior"] = f"{kind} (the rule's default)"
        if borrowed or kind != "history":
            why = "the prior is the sampler's history, with its options" if borrowed else f"the prior is {kind}"
            out.update({key: f"{out[key]} (unused, {why})" for key in ("decay", "max_evidence")})
        elif c.decay == "auto":
            out["decay"] = f"auto ({AUTO_DECAY})"
    if isinstance(c, SARAConfig):
        out["group_by"] = _group_by(c, given="group_by" in c.model_fields_set)
        if c.reweight is None:
            out["reweight"] = _reweight(c)
    if isinstance(c, DynamicSamplingConfig):
        if c.gen_batch_prompts is None:
            out["gen_batch_prompts"] = "per batch (ceil(groups still needed / the effective fraction))"
        if c.expected_effective is None:
            out["expected_effective"] = ("per batch (the step's committed share of its finished groups, 1.0 before "
                                         "any, at least 1 / max_oversample)")
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


def _sampler(sampler: PromptSampler, allocator: BudgetAllocator, options: dict[str, str]) -> dict[str, object]:
    config = getattr(sampler, "config", None)  # the registered samplers' validated options (a user's may have none)
    if not isinstance(config, BaseModel):
        return {"name": sampler.name, **options}
    out: dict[str, object] = {"name": sampler.name, **config.model_dump(mode="json")}
    if isinstance(config, PredictiveSamplerConfig):
        if config.decay == "auto":
            out["decay"] = f"auto ({AUTO_DECAY})"
        if config.population == "allocator":
            lends = isinstance(allocator, LendsPopulation) and not (
                isinstance(allocator.config, SARAConfig) and not allocator.config.group_keys)  # one population
            out["population"] = (
                f"allocator ({allocator.name}'s grid population, split by its prompt groups, where its group_by "
                "splits the pool; else the sampler's own Beta)" if lends
                else f"allocator (the sampler's own Beta, {allocator.name} lends no population)")
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
            lines += [f"#     {name}: {dump_yaml(option, one_line=True)}" for name, option in resolved[key].items()]
    return "\n".join(lines)
