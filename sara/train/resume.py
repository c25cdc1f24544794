"""What ``--resume`` checks before it uses a checkpoint: the configuration it continues, then the whole state.

A checkpoint is data (it may have been altered, or written by another run): ``check_resume(trainer, path, state)``
validates every part of it against the freshly built trainer before any of it is loaded.

1. The configuration (``compare_config``): a run continues with the checkpoint's task, policy, algorithm,
   allocator, sampler, group size, batch, surplus mode, seed and optimizer (``KEPT``); a change of one of them is a
   one-line ``ConfigError`` naming the field (the state would not mean what the config says), except the fields of
   ``SPLITS`` (the micro-batch budget), which only split the same update differently. Other fields may change
   (``steps``, ``eval``, ``checkpoint_every``, ...); each change is printed as a note.
2. The state (``validate_state``): the same keys as the fresh trainer's ``state_dict`` wherever it has them; whole
   non-negative integers where counts, steps and indices go; finite numbers; the step the file name says; pool
   indices and sampler positions inside the pool; the policy's tensors with the fresh policy's names, shapes and
   dtypes, finite; optimizer moments shaped like their parameters and hyperparameters equal to the config's; RNG
   states of the right sizes; the run files it vouches for (the metrics log's length and sha256); and the
   allocator, sampler and surplus bank must load into copies of the fresh ones.
   Any failure is a ``CheckpointError`` naming the file and the first problem: resume skips that checkpoint (with a
   warning) and tries the next older one. The checks of single values and parts are ``sara.train.state_checks``.
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO, TypeVar

from sara.config import ConfigError
from sara.train.checkpoint import CheckpointError
from sara.train.state_checks import (
    CheckedTrainer,
    check_bank,
    check_files,
    check_learner,
    check_outcomes,
    check_rng,
    equal,
    fail,
    finite,
    like,
    trial_load,
    whole,
)

if TYPE_CHECKING:
    from sara.allocators.base import BudgetAllocator
    from sara.samplers.base import PromptSampler
    from sara.train.config import TrainConfig

__all__ = ["KEPT", "SPLITS", "check_resume", "compare_config", "validate_state"]

KEPT = ("task", "policy", "policy_options", "algo", "allocator", "sampler", "k", "groups_per_step", "surplus", "seed",
        "optim")
"""Fields a resumed run must share with its checkpoint: the state was built under them."""
QUIET = ("progress", "tensorboard", "threads", "out_dir")
"""Fields whose change is not even noted."""
SPLITS = ("optim.microbatch_tokens",)
"""Fields inside ``KEPT`` ones that only split the same computation differently (the micro-batch budget cuts one loss
and gradient into forwards): a change is noted, never refused."""
TOTALS = ("rollouts", "tokens", "abandoned_tokens", "committed_groups", "effective_groups", "verifier_errors",
          "verifier_timeouts", "committed_tokens", "discarded_tokens", "aborted_tokens", "prompt_tokens",
          "trained_tokens", "seconds_collect", "seconds_advantages", "seconds_update", "seconds_sync", "peak_rss_mb",
          "flops_collect", "flops_update", "flops_eval")
_STEP = re.compile(r"^ckpt-(\d+)\.pt$")
_T = TypeVar("_T")


class ResumedTrainer(CheckedTrainer, Protocol):
    """What ``--resume`` reads of a ``sara.train.Trainer`` (named by its parts: it imports this module)."""

    @property
    def config(self) -> TrainConfig: ...
    @property
    def allocator(self) -> BudgetAllocator: ...
    @property
    def sampler(self) -> PromptSampler: ...
    def state_dict(self) -> dict[str, Any]: ...


def _diff(a: Any, b: Any, where: str) -> str | None:
    """The first path at which two JSON values differ (None: equal)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            found = _diff(a.get(key), b.get(key), f"{where}.{key}")
            if found:
                return found
        return None
    return None if a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b) else where


def compare_config(saved: object, config: TrainConfig, path: Path) -> list[str]:
    """Notes on the fields the resumed run changes; ``ConfigError`` for a field of ``KEPT`` (see the module)."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"checkpoint {path}: malformed state (no config mapping)")
    now = config.model_dump(mode="json")
    notes = []
    saved = copy.deepcopy(dict(saved))
    for dotted in SPLITS:  # compared alone, then left out of their KEPT field's comparison
        head, _, key = dotted.partition(".")
        old_part, new_part = saved.get(head), now.get(head)
        if isinstance(old_part, dict) and isinstance(new_part, dict) and key in old_part:
            before, after = old_part.pop(key), new_part.pop(key, None)
            if before != after:
                notes.append(f"--resume: field '{dotted}' changed from {before!r} to {after!r}; the run continues "
                             f"with {after!r} (it splits the same update into forwards)")
    for field in now:
        if field not in saved or field in QUIET:
            continue
        where = _diff(saved[field], now[field], field)
        if where is None:
            continue
        old: object = saved
        new: object = now
        for part in where.split("."):
            old = old.get(part) if isinstance(old, Mapping) else None
            new = new.get(part) if isinstance(new, Mapping) else None
        if field in KEPT:
            raise ConfigError(f"train config: --resume: field '{where}' is {new!r} but checkpoint {path} was written "
                              f"by a run with {old!r}; resume with the checkpoint's value, or start a new run in "
                              "another --out")
        notes.append(f"--resume: field '{where}' changed from {old!r} to {new!r}; the run continues with {new!r}")
    return notes


def validate_state(trainer: ResumedTrainer, path: Path, state: object) -> None:
    """Check ``state`` against ``trainer``'s own (see the module docstring).

    Raises:
        CheckpointError: naming the file, where in the state, and what is wrong.
    """
    try:
        _validate(trainer, path, state)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a structure no check above foresaw is refused all the same
        raise fail(path, "state", f"unexpected structure ({type(exc).__name__}: {exc})"[:300]) from None


def _validate(trainer: ResumedTrainer, path: Path, state: object) -> None:
    fresh = trainer.state_dict()
    if not isinstance(state, Mapping) or set(state) != set(fresh):
        keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise fail(path, "state", f"expected the keys {sorted(fresh)}, got {keys}"[:300])
    pool = len(trainer.env.prompts)
    c = state["counters"]
    if not isinstance(c, Mapping) or set(c) != set(fresh["counters"]):
        raise fail(path, "counters", f"expected the keys {sorted(fresh['counters'])}")
    m = _STEP.match(path.name)
    step = whole(c["step"], path, "counters.step", most=int(m.group(1)) if m else None)
    if m and step != int(m.group(1)):
        raise fail(path, "counters.step", f"{step} but the file is the checkpoint of step {int(m.group(1))}")
    whole(c["version"], path, "counters.version", most=step)
    finite(c["wall_seconds"], path, "counters.wall_seconds")
    totals = state["totals"]
    if not isinstance(totals, Mapping) or not set(totals) <= set(TOTALS):
        raise fail(path, "totals", f"expected some of the keys {list(TOTALS)}")
    for key, v in totals.items():
        finite(v, path, f"totals.{key}")
    check_outcomes(state["outcomes"], trainer.config.k, path)
    evals = state["evals"]
    if not isinstance(evals, list) or not all(isinstance(e, Mapping) and all(isinstance(k, str) for k in e)
                                              for e in evals):
        raise fail(path, "evals", "expected a list of {metric: value} records")
    for i, e in enumerate(evals):
        for key, v in e.items():
            finite(v, path, f"evals[{i}].{key}")
    check_learner(fresh["learner"], state["learner"], trainer, path)
    alloc = state["allocator"]
    if not isinstance(alloc, Mapping) or not equal(alloc.get("config"), fresh["allocator"]["config"]):
        raise fail(path, "allocator.config", "differs from the configured allocator's options")
    astep = alloc.get("step", -1)  # -1 before the first step
    like({**fresh["allocator"], "step": 0}, {**alloc, "step": 0}, path, "allocator", pool)
    if astep != -1:
        whole(astep, path, "allocator.step", most=step)
    trial_load(copy.deepcopy(trainer.allocator), lambda a: a.load_state_dict(alloc), path, "allocator", alloc)
    like(fresh["sampler"], state["sampler"], path, "sampler", pool)
    trial_load(copy.deepcopy(trainer.sampler), lambda s: s.load_state_dict(state["sampler"]), path, "sampler",
               state["sampler"])
    check_bank(state["bank"], trainer, path, pool)
    check_rng(fresh["rng"], state["rng"], path)
    check_files(state["files"], path)


def check_resume(trainer: ResumedTrainer, path: Path, state: _T, *, out: TextIO | None = None) -> _T:
    """``compare_config`` then ``validate_state``; prints the notes of changed fields to ``out`` (stderr); returns
    ``state``."""
    notes = compare_config(state.get("config") if isinstance(state, Mapping) else None, trainer.config, path)
    validate_state(trainer, path, state)
    for note in notes:
        print(f"sara: note: {note}", file=out or sys.stderr, flush=True)
    return state

