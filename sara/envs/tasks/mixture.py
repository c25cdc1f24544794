"""Weighted task mixtures: one prompt pool drawn from several component tasks, each prompt scored by its own task.

A mixture is an ordinary ``Task`` (``sara/Mixture-v0``): its training and held-out splits are drawn from component
task specs in proportion to their weights, shuffled with a seed (a pure function of the options). Every prompt keeps
its component's verifier: ``Prompt.answer`` carries ``mixture_component`` (the component's index) next to the
component's own answer fields, and the mixture's verifier (``MixtureVerifier``) dispatches on it. Prompts are stored
rendered by their component (its template, chat messages and system prompt), prompt ids are prefixed by the
component's label (``"easy/arith-000012"``), and ``Prompt.metadata["component"]`` is the label.

Spelling, in a spec string (spec options cannot nest ``,`` or ``:``, so components use ``|``, ``(...)``, ``;``, ``@``)::

    sara/Mixture-v0:components=easy=sara/Arithmetic-v0(max_digits=1;ops=+)@0.3|hard=sara/Arithmetic-v0(min_digits=3;max_digits=3)@0.7,pool_size=1000

Each component is ``[label=]TASK_ID[(key=value;...)][@weight]`` (label default ``c0``, ``c1``, ...; weight default 1).
``components`` may also name a registered mixture (``MIXTURES``, e.g. ``components=arithmetic-bands``, the default:
``sara train``'s pool). From Python, pass a list: ``make_mixture_task([("sara/Arithmetic-v0:max_digits=1", 0.3),
...])`` with ordinary spec strings (or ``(label, spec, weight)`` triples); ``register_mixture`` names one.

Sizes: the mixture's ``pool_size`` / ``eval_size`` are split over the components by weight (largest remainder). A
component whose factory takes ``pool_size`` / ``eval_size`` / ``seed`` and does not set them gets exactly its share
(and the mixture's seed); otherwise its own splits are subsampled (seeded) to its share, and a ConfigError names the
component when it has too few prompts. Held-out prompts whose text is also a training prompt (components can overlap)
are dropped, and so are repeated training texts; ``Task.metadata["components"]`` has the final counts.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from pydantic import Field

from sara.config import ConfigError, SaraModel, parse_spec, validate_config
from sara.envs.tasks.base import Task
from sara.types import Prompt

__all__ = ["MIXTURES", "MixtureConfig", "MixtureVerifier", "make_mixture_task", "parse_components",
           "register_mixture", "split_by_weight"]

TASK_ID = "sara/Mixture-v0"
COMPONENT_KEY = "mixture_component"
"""The ``Prompt.answer`` field holding the component index the verifier dispatches on."""

MIXTURES: dict[str, str] = {}
"""Named mixtures: name -> components in the ``|`` spelling (``components=NAME`` expands to it)."""
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def register_mixture(name: str, components: str, *, override: bool = False) -> None:
    """Name a mixture: ``sara/Mixture-v0:components=NAME`` then means ``components`` (the ``|`` spelling).

    Raises:
        ValueError: A name that is not ``[A-Za-z0-9_-]+`` or is taken (and ``override`` is false).
        ConfigError: Malformed components.
    """
    if not _NAME.match(name):
        raise ValueError(f"mixture name {name!r} must use only letters, digits, '_' and '-'")
    if name in MIXTURES and not override:
        raise ValueError(f"mixture {name!r} is already registered; pass override=True to replace it")
    parse_components(components)
    MIXTURES[name] = components


ARITHMETIC_BANDS = ("easy=sara/Arithmetic-v0(min_digits=1;max_digits=1;ops=+)@0.08"
                    "|two=sara/Arithmetic-v0(min_digits=2;max_digits=2;ops=+)@0.37"
                    "|three=sara/Arithmetic-v0(min_digits=3;max_digits=3;ops=+)@0.3"
                    "|four=sara/Arithmetic-v0(min_digits=4;max_digits=4;ops=+)@0.25")
"""The ``arithmetic-bands`` mixture (``sara train``'s default pool): additions of two 1-, 2-, 3- and 4-digit numbers.
For the warm-started tiny policy many 1- and 2-digit sums are always right, most 4-digit sums never, and the 2- and
3-digit bands are learnable (docs/tasks.md has the measured fractions). The 1-digit band has only 100 distinct
problems: keep ``0.08 * (pool_size + eval_size) <= 100``."""

ARITHMETIC_LLM = ("one=sara/Arithmetic-v0(min_digits=1;max_digits=1;ops=+-;shots=3)@0.1"
                  "|sum=sara/Arithmetic-v0(min_digits=1;max_digits=2;ops=+;shots=3)@0.4"
                  "|diff=sara/Arithmetic-v0(min_digits=2;max_digits=2;ops=-;shots=3)@0.25"
                  "|three=sara/Arithmetic-v0(min_digits=3;max_digits=3;ops=+;shots=3)@0.25")
"""The ``arithmetic-llm`` mixture (the real-LLM learning pool, 3-shot prompts): 1-digit sums and differences, sums
of 1-2-digit numbers, 2-digit differences and 3-digit sums. SmolLM2-135M-Instruct (bf16, T=1, 8 samples per prompt)
starts at about 26% / 9% on 1-digit sums / differences, 13% on 1-2-digit sums, 1% on 2-digit differences and 0.4% on
3-digit sums (docs/tasks.md): about 7% overall, with about 77% of its k=8 groups saturated, most of them unsolved.
The 1-digit band has 200 distinct problems: keep ``0.1 * (pool_size + eval_size) <= 190``."""

_COMPONENT = re.compile(r"^\s*(?:(?P<label>[A-Za-z0-9_.-]+)\s*=\s*)?(?P<id>[^()@=|\s]+)\s*"
                        r"(?:\((?P<opts>[^()]*)\))?\s*(?:@\s*(?P<weight>[^()@|\s]+))?\s*$")
_UNKNOWN = re.compile(r"field '(pool_size|eval_size|seed)': unknown option")
_LABEL = re.compile(r"^[A-Za-z0-9_.-]+$")


class MixtureConfig(SaraModel):
    """Sizes and seed of a mixture (the components are parsed separately, see ``parse_components``)."""

    pool_size: int = Field(1000, ge=1, le=1_000_000)
    """Training prompts in all, split over the components by weight, at most 1,000,000."""
    eval_size: int = Field(200, ge=0, le=100_000)
    """Held-out prompts in all, split over the components by weight, at most 100,000."""
    seed: int = Field(0, ge=0)
    """Seed of the components (those that take one and do not set it), the subsampling and the shuffle."""


class MixtureVerifier:
    """``verify(completion, *, mixture_component, **answer)``: the component's verifier on its own answer fields.

    Picklable when every component verifier is (tasks that are not thread-safe are scored in worker processes).
    """

    def __init__(self, verifiers: Sequence[Any]) -> None:
        self.verifiers = tuple(verifiers)

    @property
    def thread_safe(self) -> bool:
        """Whether every component verifier may run in a thread (``sara.envs.tasks.scoring.verifier_thread_safe``)."""
        from sara.envs.tasks.scoring import verifier_thread_safe

        return all(verifier_thread_safe(v) for v in self.verifiers)

    def __call__(self, completion: str, **answer: Any) -> float | None:
        index = answer.pop(COMPONENT_KEY)
        return self.verifiers[int(index)](completion, **answer)

    def __repr__(self) -> str:
        return f"MixtureVerifier({len(self.verifiers)} components)"


def parse_components(value: str | Sequence[Any]) -> list[tuple[str, str, float]]:
    """``[(label, spec, weight), ...]`` from the ``|`` spelling or from ``(spec, weight)`` / ``(label, spec, weight)``
    items (``spec`` an ordinary ``"id:key=value,..."`` string).

    Raises:
        ConfigError: A malformed component, a repeated label or a weight that is not a positive number.
    """
    what = f"task {TASK_ID!r}: field 'components'"
    if isinstance(value, str) and value.strip() in MIXTURES:
        value = MIXTURES[value.strip()]
    items: list[tuple[str, str, Any]] = []
    if isinstance(value, str):
        for i, part in enumerate(value.split("|")):
            m = _COMPONENT.match(part)
            if m is None:
                raise ConfigError(f"{what}: component {part.strip()!r} must look like "
                                  "'[label=]TASK_ID[(key=value;...)][@weight]', e.g. "
                                  "'easy=sara/Arithmetic-v0(max_digits=1;ops=+)@0.3'")
            opts = [o.strip() for o in (m.group("opts") or "").split(";") if o.strip()]
            spec = m.group("id") + (":" + ",".join(opts) if opts else "")
            items.append((m.group("label") or f"c{i}", spec, m.group("weight") or 1.0))
    else:
        for i, item in enumerate(value):
            parts = tuple(item) if isinstance(item, (tuple, list)) else (item,)
            if len(parts) == 1:
                parts = (f"c{i}", parts[0], 1.0)
            elif len(parts) == 2:
                parts = (f"c{i}", *parts)
            if len(parts) != 3 or not isinstance(parts[1], str):
                raise ConfigError(f"{what}: item {i} must be (spec, weight) or (label, spec, weight), got {item!r}")
            items.append(parts)  # type: ignore[arg-type]
    if not items:
        raise ConfigError(f"{what}: give at least one component")
    out = []
    for label, spec, weight in items:
        try:
            w = float(weight)
        except (TypeError, ValueError):
            w = float("nan")
        if not (w > 0 and np.isfinite(w)):
            raise ConfigError(f"{what}: component {label!r} has weight {weight!r}; use a positive number")
        if not _LABEL.match(str(label)):
            raise ConfigError(f"{what}: label {label!r} must use only letters, digits, '_', '.', '-'")
        parse_spec(spec)  # a malformed spec raises ConfigError here
        out.append((str(label), spec, w))
    labels = [label for label, _, _ in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{what}: labels must be distinct, got {labels}")
    return out


def split_by_weight(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder, ties to the first): sums to ``total``."""
    w = np.asarray(weights, dtype=float)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(int)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - counts.sum()]] += 1
    return counts.tolist()


def _build_component(spec: str, n_train: int, n_eval: int, seed: int, index: int, label: str) -> Task:
    from sara.envs.tasks import TASKS, make_task

    name, given = parse_spec(spec)
    try:
        params = inspect.signature(TASKS.get(name)).parameters
    except (KeyError, TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {key: value for key, value in (("pool_size", n_train), ("eval_size", n_eval), ("seed", seed))
             if key not in given and (key in params or takes_any)}
    try:
        try:
            task = make_task(spec, **extra)
        except ConfigError as exc:  # a factory taking **options may not know some of them: build without those
            unknown = set(_UNKNOWN.findall(str(exc))) & set(extra)
            if not unknown:
                raise
            task = make_task(spec, **{key: value for key, value in extra.items() if key not in unknown})
    except ConfigError as exc:
        raise ConfigError(f"task {TASK_ID!r}: component {label!r} ({spec}): {exc}") from None
    rng = np.random.default_rng([seed, 0x313C, index])
    for split, want in (("prompts", n_train), ("eval_prompts", n_eval)):
        have = len(getattr(task, split))
        if have < want:
            field = "pool_size" if split == "prompts" else "eval_size"
            raise ConfigError(f"task {TASK_ID!r}: field '{field}': component {label!r} ({spec}) has {have} "
                              f"{'training' if split == 'prompts' else 'held-out'} prompts and its share is {want}; "
                              f"lower {field} or its weight, or give the component more prompts")
        if have > want:
            keep = np.sort(rng.choice(have, size=want, replace=False))
            task = replace(task, **{split: [getattr(task, split)[i] for i in keep]})
    return task


def _relabel(task: Task, prompts: Sequence[Prompt], index: int, label: str) -> list[Prompt]:
    return [Prompt(id=f"{label}/{p.id}", prompt=task.render(p), answer={**p.answer, COMPONENT_KEY: index},
                   metadata={**p.metadata, "component": label}) for p in prompts]


def _key(prompt: Prompt) -> str:
    return str(prompt.prompt)


def make_mixture_task(components: str | Sequence[Any] = "arithmetic-bands", **options: Any) -> Task:
    """A weighted mixture of tasks (``sara/Mixture-v0``).

    Args:
        components: The ``|`` spelling (see the module docstring) or a list of ``(spec, weight)`` /
            ``(label, spec, weight)`` items, or the name of a registered mixture.
        **options: ``MixtureConfig`` fields: ``pool_size``, ``eval_size``, ``seed``.

    Raises:
        ConfigError: A bad component or option (the message names it), or components that disagree on ``chat``.
    """
    task_id = TASK_ID
    cfg = validate_config(MixtureConfig, options, what=f"task {task_id!r}")
    parsed = parse_components(components)
    weights = [w for _, _, w in parsed]
    n_train, n_eval = split_by_weight(cfg.pool_size, weights), split_by_weight(cfg.eval_size, weights)
    tasks = [_build_component(spec, n_train[i], n_eval[i], cfg.seed, i, label)
             for i, (label, spec, _) in enumerate(parsed)]
    chats = {t.chat for t in tasks}
    if len(chats) > 1:
        raise ConfigError(f"task {task_id!r}: field 'components': components mix chat and plain-text rendering "
                          f"({', '.join(f'{label}: chat={t.chat}' for (label, _, _), t in zip(parsed, tasks))}); "
                          "give each component the same chat setting")
    train = [p for i, (t, (label, _, _)) in enumerate(zip(tasks, parsed)) for p in _relabel(t, t.prompts, i, label)]
    held = [p for i, (t, (label, _, _)) in enumerate(zip(tasks, parsed))
            for p in _relabel(t, t.eval_prompts, i, label)]
    _, first = np.unique(np.asarray([_key(p) for p in train], dtype=object), return_index=True)
    train = [train[i] for i in np.sort(first)]  # repeated texts (overlapping components): keep the first
    seen = {_key(p) for p in train}
    held = [p for p in held if _key(p) not in seen]
    rng = np.random.default_rng([cfg.seed, 0x313D])
    train = [train[i] for i in rng.permutation(len(train))]
    held = [held[i] for i in rng.permutation(len(held))]
    stops = [set(t.stop) for t in tasks]
    common_stop = tuple(s for s in tasks[0].stop if all(s in other for other in stops))
    caps = [t.max_new_tokens for t in tasks]
    alphabets = [t.metadata.get("alphabet") for t in tasks]
    meta: dict[str, Any] = {
        "config": {**cfg.model_dump(), "components": [list(c) for c in parsed]},
        "components": [{"label": label, "spec": spec, "weight": w,
                        "train": sum(p.metadata["component"] == label for p in train),
                        "eval": sum(p.metadata["component"] == label for p in held)} for label, spec, w in parsed],
    }
    if all(alphabets):
        meta["alphabet"] = "".join(dict.fromkeys("".join(alphabets)))  # type: ignore[arg-type]
    return Task(
        id=task_id,
        prompts=train,
        eval_prompts=held,
        verifier=MixtureVerifier([t.verifier for t in tasks]),
        template="{prompt}",
        chat=tasks[0].chat,
        thread_safe=all(t.thread_safe for t in tasks),
        timeout_s=max(t.timeout_s for t in tasks),
        stop=common_stop,
        max_new_tokens=None if None in caps else max(caps),  # type: ignore[type-var]
        description="weighted mixture of " + ", ".join(f"{label}={spec} ({w:g})" for label, spec, w in parsed),
        metadata=meta,
    )



register_mixture("arithmetic-bands", ARITHMETIC_BANDS)
register_mixture("arithmetic-llm", ARITHMETIC_LLM)
