"""Training-run configuration: ``TrainConfig`` (with ``OptimConfig`` and ``EvalConfig``), ``key=value`` overrides, and
loading from YAML/JSON. Every invalid value is a ``ConfigError`` that names the field.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from sara.backends.ray.config import RayTrainOptions
from sara.config import (
    MAX_SEED,
    MAX_STEPS,
    MIN_TEMPERATURE,
    ConfigError,
    SaraModel,
    parse_spec,
    validate_config,
)
from sara.driver import DriverConfig
from sara.train.sections import (
    MAX_GROUP_SIZE,
    MAX_GROUPS_PER_STEP,
    MAX_KEPT_CHECKPOINTS,
    MAX_ROLLOUTS,
    MAX_STEP_ROLLOUTS,
    MAX_STEP_TOKENS,
    MAX_THREADS,
    EvalConfig,
    OptimConfig,
)

if TYPE_CHECKING:
    from sara.build import AllocationChoice

__all__ = ["TrainConfig", "load_config", "apply_overrides", "default_threads", "MAX_NEW_TOKENS", "TINY_POLICY_OPTIONS"]

TINY_POLICY_OPTIONS: dict[str, Any] = {"warm_start": {"steps": 1500, "target_loss": 0.81}}
"""``policy_options`` of a ``tiny`` policy when none are given: a supervised warm start to a mean loss of 0.81 (at
most 1500 steps), which leaves most of the default pool's k-groups saturated (1-digit sums mostly solved, 3- and
4-digit ones unsolved) and the 2-digit band learnable, so held-out accuracy keeps rising through a run
(docs/tasks.md). A loss, not a step count: the same number of steps lands at different losses on different machines
(600 steps give 15% held-out accuracy on one and 36% on another; ``WarmStartConfig.target_loss``)."""


MAX_NEW_TOKENS = 131_072
"""Largest ``TrainConfig.max_new_tokens``: 128 Ki tokens, the longest context of common models."""


class TrainConfig(SaraModel):
    """A training run. The defaults are ``sara train``'s embedded run: GRPO + SARA on the tiny policy and a mixture
    of arithmetic widths (``sara/Mixture-v0:components=arithmetic-bands``; a few minutes on 2 CPU cores)."""

    name: str = "grpo-sara-arithmetic"
    """Run name (the default output directory is ``runs/<name>``): non-empty, relative, no ``..``."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of rollouts, prompt order and mini-batch order, in [0, ``MAX_SEED``]."""
    task: str = "sara/Mixture-v0:components=arithmetic-bands,pool_size=1000,eval_size=200"
    """Task id or spec, see ``sara.envs.tasks``, or a ``Task`` object (registered by ``sara.envs.tasks.task_spec``
    and replaced by the name it got: its id, or ``<id>#<n>`` when that id names something else). Default: a fixed
    pool of 1000 additions of two 1-, 2-, 3- and 4-digit numbers (weights 0.08 / 0.37 / 0.3 / 0.25; docs/tasks.md):
    for the warm-started tiny policy most k-groups are all right or all wrong, with a learnable band between, and a
    run makes several passes over the pool."""
    policy: str = "tiny"
    """Policy spec: a factory name in ``sara.policies.POLICIES`` (or ``"module:attr"``), with options like every other
    spec, e.g. ``"hf:model=smollm2,dtype=float32"``."""
    policy_options: dict[str, Any] = Field(default_factory=dict)
    """More options for the policy factory, for nested or typed values a spec string cannot carry (tiny:
    ``TinyConfig`` fields and ``warm_start``). An option may be given here or in ``policy``, not both. Not given and
    ``policy`` is ``tiny``: ``TINY_POLICY_OPTIONS`` (the embedded run's warm start; giving ``policy_options`` replaces
    the whole mapping)."""
    backend: str = "tiny"
    """Generation backend spec: a factory name in ``sara.backends.BACKENDS`` (or ``"module:attr"``), with options,
    e.g. ``"hf:max_batch_size=32"``."""
    backend_options: dict[str, Any] = Field(default_factory=dict)
    """More options for the backend factory (as ``policy_options``). An option may be given here or in ``backend``,
    not both."""
    ray: RayTrainOptions = Field(default_factory=RayTrainOptions)
    """Distributed rollouts: ``ray.enabled`` runs ``ray.num_workers`` copies of the backend on Ray actors
    (``sara train --ray --num-workers N [--ray-address ADDR]``; see docs/ray.md)."""
    algo: str = "grpo"
    """Algorithm spec, e.g. ``"grpo"``, ``"ppo:lam=0.95"`` (see ``sara.algos.ALGOS``)."""
    allocator: str = "sara"
    """Allocator spec, e.g. ``"sara"``, ``"sara_paper:tau_low=0.45"``, ``"ds"``, ``"uniform"`` (see
    ``sara.allocators``); read once, when the config is made, into ``allocation``."""
    sampler: str = "uniform"
    """Prompt sampler spec, e.g. ``"uniform"``, ``"predictive:decay=0.95"`` (see ``sara.samplers.SAMPLERS``); read
    with the allocator's."""
    k: int = Field(8, ge=2, le=MAX_GROUP_SIZE)
    """Group size (rollouts per prompt when a group is complete), at most ``MAX_GROUP_SIZE``: the one source of ``k``
    for the allocator, the sampler and the DS estimate (an allocator or sampler spec that sets another ``k`` is an
    error)."""
    groups_per_step: int = Field(32, ge=1, le=MAX_GROUPS_PER_STEP)
    """Committed groups wanted per step (the training batch, in groups), at most ``MAX_GROUPS_PER_STEP``; with ``k``,
    at most ``MAX_STEP_ROLLOUTS`` rollouts (and ``MAX_STEP_TOKENS`` tokens at ``max_new_tokens``) a step."""
    max_rollouts_per_step: int | None = Field(None, ge=1, le=MAX_ROLLOUTS)
    """Hard rollout budget of one step, at most ``MAX_ROLLOUTS`` (None = none)."""
    rollout_budget: int | None = Field(None, ge=1, le=MAX_ROLLOUTS)
    """Rollouts for the whole run, at most ``MAX_ROLLOUTS``; training stops when it is spent (None = run ``steps`` steps)."""
    steps: int = Field(80, ge=0, le=MAX_STEPS)
    """Training (collection) steps at most, itself at most ``MAX_STEPS``."""
    temperature: float = Field(1.0, ge=MIN_TEMPERATURE, le=10)
    """Sampling temperature of training rollouts and of ``eval/acc_sample``, in [``MIN_TEMPERATURE``, 10] (0.01: a
    lower one is greedy decoding in all but name, which no group-relative algorithm learns from)."""
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    """Generation cap, at most ``MAX_NEW_TOKENS`` (None = the task's suggestion)."""
    scorer: Literal["auto", "thread", "process", "inline"] = "auto"
    """How the verifier runs (see ``sara.envs.TaskEnv``)."""
    driver: DriverConfig = Field(default_factory=DriverConfig)
    """How collection runs (``sara.driver.DriverConfig``): synchronous rounds (the default), or streaming rollout by
    rollout on a streaming backend (tiny, hf, vllm) with ``barrier: false`` (``sara train --driver stream``; the
    strings ``sync`` / ``stream`` are shorthands), with its options ``slots``, ``carry_lag``, ``complete_groups``,
    ``fill_idle``. Carried rollouts are trained with the generator's log-probs as old log-probs (the clipped ratio
    corrects their age); a step that writes a checkpoint, and the run's last step, carry nothing, so resuming
    reproduces the run. See docs/streaming.md."""
    surplus: Literal["bank", "train"] = "bank"
    """Committed groups a step produces beyond ``groups_per_step`` (sara's drained units, a stream's last arrivals,
    DS's whole rounds): 'bank' keeps them for the next step's batch, which then collects only what is missing (the
    batch stays ``groups_per_step``; saved rollouts become more optimizer steps; banked groups are one weight update
    stale and trained with their generator's log-probs); 'train' trains them at once (the batch grows). See
    ``sara.train.bank``."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation (skipped, with a note, for a task without held-out prompts)."""
    max_verifier_failure_share: float = Field(0.5, ge=0, le=1)
    """Stop the run (with an error naming the verifier and one failing completion) when the task's verifier raises or
    times out on more than this share of a step's rollouts: a broken verifier scores everything 0, which would
    otherwise look like a hard task. 1 = never stop; the counts are logged as ``env/verifier_errors`` and
    ``env/verifier_timeouts`` either way."""
    checkpoint_every: int = Field(0, ge=0, le=MAX_STEPS)
    """Write a checkpoint every this many steps, at most ``MAX_STEPS`` (0 = only at the end)."""
    keep_checkpoints: int = Field(2, ge=1, le=MAX_KEPT_CHECKPOINTS)
    """Checkpoints kept on disk, at most ``MAX_KEPT_CHECKPOINTS``."""
    out_dir: str | None = None
    """Output directory, a path taken literally (None = ``runs/<name>``). One run at a time writes to it (a lock
    file, ``.sara.lock``)."""
    threads: int | None = Field(None, ge=1, le=MAX_THREADS)
    """``torch.set_num_threads``, at most ``MAX_THREADS`` (None = leave torch's default)."""
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool | None = None
    """Write TensorBoard events (None = when installed)."""

    _allocation: AllocationChoice | None = PrivateAttr(default=None)

    @field_validator("name")
    @classmethod
    def _name_is_relative(cls, v: str) -> str:
        if not v.strip() or "\x00" in v or v.startswith(("/", "\\")) or ".." in Path(v).parts:
            raise ValueError(f"{v!r} is not a run name: the default output directory is runs/<name>, so give a "
                             "non-empty relative name without '..' (or an output directory with --out)")
        return v

    @field_validator("task", mode="before")
    @classmethod
    def _task_object(cls, v: Any) -> Any:
        from sara.envs.tasks import Task, task_spec

        return task_spec(v) if isinstance(v, Task) else v

    @field_validator("out_dir")
    @classmethod
    def _out_dir_is_a_path(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or "\x00" in v):
            raise ValueError("an empty output directory; give a directory (--out DIR), or leave out_dir unset for "
                             "runs/<name>")
        return v

    @field_validator("driver", mode="before")
    @classmethod
    def _driver_shorthand(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip() in ("sync", "stream"):
            return {"barrier": v.strip() == "sync"}
        return v

    @model_validator(mode="before")
    @classmethod
    def _tiny_defaults(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "policy_options" not in data:
            policy = data.get("policy", "tiny")
            if isinstance(policy, str) and policy.strip().partition(":")[0] == "tiny":
                data = {**data, "policy_options": copy.deepcopy(TINY_POLICY_OPTIONS)}
        return data

    @model_validator(mode="after")
    def _check_specs(self) -> TrainConfig:
        for field in ("task", "algo", "allocator", "sampler"):
            try:
                parse_spec(getattr(self, field))
            except ConfigError as exc:
                raise ValueError(f"field '{field}': {exc}") from None
        for field in ("policy", "backend"):
            self.component(field)  # type: ignore[arg-type]
        from sara.allocators import choose_allocator
        from sara.build import AllocationChoice
        from sara.samplers import choose_sampler, make_sampler

        field = "allocator"
        try:  # the specs read once, here: a bad option fails when the config is made, not once the model has loaded
            allocator = choose_allocator(self.allocator, k=self.k)
            field = "sampler"
            sampler = choose_sampler(self.sampler, k=self.k)
            if sampler.config is None:  # a sampler without a Config validates in its constructor: build one
                make_sampler(sampler, 1, seed=self.seed)
        except ConfigError as exc:
            raise ValueError(f"field '{field}': {exc}") from None
        self._allocation = AllocationChoice(allocator, sampler)
        rollouts = self.k * self.groups_per_step
        if rollouts > MAX_STEP_ROLLOUTS:
            raise ValueError(f"field 'groups_per_step': k x groups_per_step = {rollouts:,} rollouts a step, more than "
                             f"{MAX_STEP_ROLLOUTS:,}; lower groups_per_step or k")
        if self.max_new_tokens is not None and rollouts * self.max_new_tokens > MAX_STEP_TOKENS:
            raise ValueError(f"field 'max_new_tokens': k x groups_per_step x max_new_tokens = "
                             f"{rollouts * self.max_new_tokens:,} tokens a step, more than {MAX_STEP_TOKENS:,}; lower "
                             "max_new_tokens, groups_per_step or k")
        return self

    @property
    def allocation(self) -> AllocationChoice:
        """The run's allocator and sampler, typed: the classes the specs name and their options, validated with the
        run's ``k`` when the config is made (``sara.build.choose_allocation``; a copy whose specs or ``k`` were
        replaced without validation, ``model_copy(update=...)``, reads them again). The trainer builds from it and
        ``--print-config`` prints it."""
        made = self._allocation
        if made is None or (made.allocator.spec, made.sampler.spec, made.allocator.config.k) != (
                self.allocator.strip(), self.sampler.strip(), self.k):
            from sara.build import choose_allocation
            made = self._allocation = choose_allocation(self.allocator, self.sampler, k=self.k)
        return made

    def component(self, field: Literal["policy", "backend"]) -> tuple[str, dict[str, Any]]:
        """``(factory name, options)`` of the policy or the backend: the spec string's options plus ``<field>_options``.

        Raises:
            ValueError: a malformed spec, or an option given both in the spec and in ``<field>_options`` (pydantic
                turns it into a ``ConfigError`` naming the field).
        """
        try:
            name, options = parse_spec(getattr(self, field))
        except ConfigError as exc:
            raise ValueError(f"field '{field}': {exc}") from None
        extra = getattr(self, f"{field}_options")
        both = sorted(set(options) & set(extra))
        if both:
            raise ValueError(f"field '{field}': option(s) {', '.join(both)} given both in the spec and in "
                             f"'{field}_options'; keep one")
        return name, {**options, **extra}

    @property
    def output_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("runs") / self.name


def _is_text(model: type[BaseModel] | None, path: Sequence[str]) -> tuple[bool, bool]:
    """``(text, optional)``: whether the field at ``path`` of ``model`` is a string (``str`` or ``str | None``), and
    whether it may be None."""
    for i, part in enumerate(path):
        info = model.model_fields.get(part) if model is not None else None
        if info is None:
            return False, False
        args = [a for a in get_args(info.annotation)] if get_origin(info.annotation) is not None else []
        types = [a for a in args if a is not type(None)] or [info.annotation]
        if i == len(path) - 1:
            return types == [str], type(None) in args
        nested = types[0] if len(types) == 1 and isinstance(types[0], type) else None
        model = nested if nested is not None and issubclass(nested, BaseModel) else None
    return False, False


def apply_overrides(data: dict[str, Any], overrides: Sequence[str], *,
                    model: type[BaseModel] | None = None) -> dict[str, Any]:
    """Apply ``key=value`` / ``a.b=value`` overrides to a nested dict.

    A value for a string field of ``model`` (names, paths, specs) is kept as the text given (``name=12:30``,
    ``task=a #1``), except that an optional one takes ``null`` for None; any other value is read as YAML 1.2
    (``sara.configfile.parse_value``: numbers, ``true`` / ``false``, ``null``, flow lists and mappings).

    Raises:
        ConfigError: a malformed item, a key into a field that is not a section, or a YAML value that is too big.
    """
    from sara.configfile import parse_value

    out = copy.deepcopy(data)
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key or any(not p.strip() for p in key.split(".")):
            raise ConfigError(f"override {item!r} must look like key=value (e.g. --set optim.lr=1e-4)")
        parts = [p.strip() for p in key.split(".")]
        text, optional = _is_text(model, parts)
        if text:
            value: Any = None if optional and raw.strip() == "null" else raw
        else:
            value = parse_value(raw, what=f"override {key!r}")
        node = out
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: field '{p}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                base: Mapping[str, Any] | None = None, values: Mapping[str, Any] | None = None) -> TrainConfig:
    """A ``TrainConfig`` from an optional YAML/JSON file, ``key=value`` overrides, then ``values`` (fields set as
    given, e.g. ``{"out_dir": args.out}``: never parsed). Errors name the field, the file or the override.

    Raises:
        ConfigError: an unreadable or invalid file (not UTF-8, not YAML, a duplicate key, an alias bomb, not a
            mapping), a malformed override, or an invalid field value.
    """
    from sara.configfile import load_yaml, read_config

    data: dict[str, Any] = dict(base or {})
    if path is not None:
        loaded = load_yaml(read_config(path, expected="YAML/JSON file of TrainConfig fields"), what=f"config {path}")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {path}: expected a mapping of TrainConfig fields at the top level")
        data.update(loaded)
    data = apply_overrides(data, overrides, model=TrainConfig)
    data.update(values or {})
    return validate_config(TrainConfig, data, what="train config")


def default_threads() -> int:
    """Threads for torch: the cores this process may use (at most ``MAX_THREADS``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_THREADS))
