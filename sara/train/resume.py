"""What ``--resume`` checks before it uses a checkpoint: the configuration it continues, then the whole state.

A checkpoint is data (it may have been altered, or written by another run): ``check_resume(trainer, path, state)``
validates every part of it against the freshly built trainer before any of it is loaded.

1. The configuration (``compare_config``): a run continues with the checkpoint's task, policy, algorithm,
   allocator, sampler, group size, batch, surplus mode, seed and optimizer (``KEPT``); a change of one of them is a
   one-line ``ConfigError`` naming the field (the state would not mean what the config says). Other fields may
   change (``steps``, ``eval``, ``checkpoint_every``, ...); each change is printed as a note.
2. The state (``validate_state``): the same keys as the fresh trainer's ``state_dict`` wherever it has them; whole
   non-negative integers where counts, steps and indices go; finite numbers; the step the file name says; pool
   indices and sampler positions inside the pool; the policy's tensors with the fresh policy's names, shapes and
   dtypes, finite; optimizer moments shaped like their parameters and hyperparameters equal to the config's; RNG
   states of the right sizes; and the allocator, sampler and surplus bank must load into copies of the fresh ones.
   Any failure is a ``CheckpointError`` naming the file and the first problem: resume skips that checkpoint (with a
   warning) and tries the next older one.
"""

from __future__ import annotations

import copy
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sara.config import ConfigError
from sara.train.checkpoint import CheckpointError

__all__ = ["KEPT", "check_resume", "compare_config", "validate_state"]

KEPT = ("task", "policy", "policy_options", "algo", "allocator", "sampler", "k", "groups_per_step", "surplus", "seed",
        "optim")
"""Fields a resumed run must share with its checkpoint: the state was built under them."""
QUIET = ("progress", "tensorboard", "threads", "out_dir")
"""Fields whose change is not even noted."""
POOL_INDEXED = ("pool_index", "pos")
"""State keys holding a position in the prompt pool (a sampler's position in its pass, a group's prompt)."""
TOTALS = ("rollouts", "tokens", "abandoned_tokens", "committed_groups", "effective_groups", "verifier_errors",
          "verifier_timeouts")
_STEP = re.compile(r"^ckpt-(\d+)\.pt$")


def _diff(a: Any, b: Any, where: str) -> str | None:
    """The first path at which two JSON values differ (None: equal)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            found = _diff(a.get(key), b.get(key), f"{where}.{key}")
            if found:
                return found
        return None
    return None if a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b) else where


def compare_config(saved: Any, config: Any, path: Path) -> list[str]:
    """Notes on the fields the resumed run changes; ``ConfigError`` for a field of ``KEPT`` (see the module)."""
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"checkpoint {path}: malformed state (no config mapping)")
    now = config.model_dump(mode="json")
    notes = []
    for field in now:
        if field not in saved or field in QUIET:
            continue
        where = _diff(saved[field], now[field], field)
        if where is None:
            continue
        old, new = saved, now
        for part in where.split("."):
            old = old.get(part) if isinstance(old, Mapping) else None
            new = new.get(part) if isinstance(new, Mapping) else None
        if field in KEPT:
            raise ConfigError(f"train config: --resume: field '{where}' is {new!r} but checkpoint {path} was written "
                              f"by a run with {old!r}; resume with the checkpoint's value, or start a new run in "
                              "another --out")
        notes.append(f"--resume: field '{where}' changed from {old!r} to {new!r}; the run continues with {new!r}")
    return notes


def _eq(a: Any, b: Any) -> bool:
    """Equal, of the same kinds, element by element (arrays and tensors included); never raises."""
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return isinstance(a, Mapping) and isinstance(b, Mapping) and set(a) == set(b) and all(_eq(a[k], b[k])
                                                                                               for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    if isinstance(a, (bool, np.bool_)) != isinstance(b, (bool, np.bool_)):
        return False
    scalars = (int, float, str, type(None), np.integer, np.floating, np.bool_)
    if not (isinstance(a, scalars) and isinstance(b, scalars)):
        return False
    try:
        return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    except Exception:  # noqa: BLE001
        return False


def _fail(path: Path, where: str, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: {where}: {problem}")


def _count(value: Any, path: Path, where: str, *, most: int | None = None) -> int:
    """A whole non-negative ``int`` (not a bool, not a float), at most ``most``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _fail(path, where, f"expected a whole number, got {type(value).__name__} {value!r}"[:300])
    if value < 0 or (most is not None and value > most):
        raise _fail(path, where, f"{value} is out of range [0, {most if most is not None else 'inf'}]")
    return int(value)


def _number(value: Any, path: Path, where: str) -> float:
    """A finite non-negative number."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise _fail(path, where, f"expected a number, got {type(value).__name__} {value!r}"[:300])
    if not math.isfinite(float(value)) or value < 0:
        raise _fail(path, where, f"{value!r} is not a finite non-negative number")
    return float(value)


def _like(fresh: Any, got: Any, path: Path, where: str, pool: int) -> None:
    """``got`` has ``fresh``'s structure where ``fresh`` pins it down (non-empty mappings: the same keys; tuples:
    the same length; scalars: the same kind; arrays: the same dtype kind and rank, and shape when ``fresh`` is
    non-empty), and every number in it is finite and non-negative (pool positions below ``pool``)."""
    if isinstance(fresh, Mapping) and fresh:
        if not isinstance(got, Mapping):
            raise _fail(path, where, f"expected a mapping, got {type(got).__name__}")
        missing, extra = sorted(set(fresh) - set(got), key=str), sorted(set(got) - set(fresh), key=str)
        if missing or extra:
            raise _fail(path, where, f"missing {missing} / unexpected {extra} keys" if missing and extra else
                        f"missing key {missing[0]!r}" if missing else f"unexpected key {extra[0]!r}")
        for key in fresh:
            _like(fresh[key], got[key], path, f"{where}.{key}", pool)
            if key in POOL_INDEXED and isinstance(got[key], (int, np.integer)) and got[key] > pool:
                raise _fail(path, f"{where}.{key}", f"{got[key]} is outside the pool of {pool} prompts")
        return
    if isinstance(fresh, list) and not isinstance(got, list):
        raise _fail(path, where, f"expected a list, got {type(got).__name__}")
    if isinstance(fresh, tuple):
        if not isinstance(got, tuple) or len(got) != len(fresh):
            raise _fail(path, where, f"expected a tuple of {len(fresh)}, got {type(got).__name__}")
        for i, (f, g) in enumerate(zip(fresh, got)):
            _like(f, g, path, f"{where}[{i}]", pool)
        return
    if isinstance(fresh, np.ndarray):
        if not isinstance(got, np.ndarray) or got.dtype.kind != fresh.dtype.kind or got.ndim != fresh.ndim or (
                fresh.size and got.shape != fresh.shape):
            shape = f"{got.dtype} {got.shape}" if isinstance(got, np.ndarray) else type(got).__name__
            raise _fail(path, where, f"expected a {fresh.dtype} array of shape {fresh.shape}, got {shape}")
    elif isinstance(fresh, (bool, np.bool_)):
        if not isinstance(got, (bool, np.bool_)):
            raise _fail(path, where, f"expected a bool, got {type(got).__name__} {got!r}"[:300])
    elif isinstance(fresh, (int, np.integer)):
        _count(got, path, where)
    elif isinstance(fresh, (float, np.floating)):
        _number(got, path, where)
    elif isinstance(fresh, str) and not isinstance(got, str):
        raise _fail(path, where, f"expected a string, got {type(got).__name__}")
    _values(got, path, where)


def _values(node: Any, path: Path, where: str) -> None:
    """Every number in ``node`` is finite and non-negative (whole where it is an integer)."""
    stack = [(node, where)]
    while stack:
        x, at = stack.pop()
        if isinstance(x, Mapping):
            stack.extend((v, f"{at}.{k}") for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(x))
        elif isinstance(x, np.ndarray) and x.dtype.kind in "biuf" and x.size:
            if x.dtype.kind == "f" and not np.isfinite(x).all() or x.dtype.kind in "if" and (x < 0).any():
                raise _fail(path, at, "an array holds negative or non-finite values")
        elif isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)):
            _number(x, path, at)


def _learner(fresh: Mapping[str, Any], got: Any, trainer: Any, path: Path) -> None:
    import torch

    if not isinstance(got, Mapping) or set(got) != set(fresh) or not {"policy", "optimizer"} <= set(fresh):
        raise _fail(path, "learner", f"expected the keys {sorted(fresh)}")
    for key in set(fresh) - {"policy", "optimizer", "optimizer_steps"}:
        _like(fresh[key], got[key], path, f"learner.{key}", 0)
    weights = got["policy"]
    if not isinstance(weights, Mapping) or set(weights) != set(fresh["policy"]):
        raise _fail(path, "learner.policy", "the tensor names differ from this policy's")
    for name, ref in fresh["policy"].items():
        t = weights[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            raise _fail(path, f"learner.policy.{name}", f"expected a {ref.dtype} tensor of shape {tuple(ref.shape)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise _fail(path, f"learner.policy.{name}", "holds nan or inf")
    if "optimizer_steps" in fresh:
        _count(got["optimizer_steps"], path, "learner.optimizer_steps")
    opt, ref_opt = got["optimizer"], fresh["optimizer"]
    if not isinstance(opt, Mapping) or set(opt) != set(ref_opt) or not isinstance(opt["param_groups"], list) \
            or len(opt["param_groups"]) != len(ref_opt["param_groups"]) or not isinstance(opt["state"], Mapping):
        raise _fail(path, "learner.optimizer", "not this optimizer's state (its parameter groups differ)")
    shapes: dict[Any, tuple[int, ...]] = {}
    for i, (g, ref, live) in enumerate(zip(opt["param_groups"], ref_opt["param_groups"],
                                           trainer.learner.optimizer.param_groups)):
        if not isinstance(g, Mapping) or not _eq(g.get("params"), ref["params"]):
            raise _fail(path, f"learner.optimizer.param_groups[{i}]", "its parameters differ from this policy's")
        for key in set(g) & set(ref) - {"params", "lr", "initial_lr"}:
            if not _eq(g[key], ref[key]):
                raise _fail(path, f"learner.optimizer.param_groups[{i}].{key}",
                            f"{g[key]!r} differs from the config's {ref[key]!r}"[:300])
        shapes.update({pid: tuple(p.shape) for pid, p in zip(ref["params"], live["params"])})
    for pid, entry in opt["state"].items():
        if pid not in shapes or not isinstance(entry, Mapping):
            raise _fail(path, f"learner.optimizer.state[{pid!r}]", "not a parameter of this policy")
        for key, t in entry.items():
            ok = isinstance(t, torch.Tensor) and (t.ndim == 0 or tuple(t.shape) == shapes[pid])
            if not ok or (t.is_floating_point() and not bool(torch.isfinite(t).all())):
                raise _fail(path, f"learner.optimizer.state[{pid!r}].{key}",
                            f"expected a finite tensor of shape {shapes[pid]}")


def _rng(fresh: Mapping[str, Any], got: Any, path: Path) -> None:
    import torch

    ok = isinstance(got, Mapping) and set(got) == set(fresh)
    py = got.get("python") if ok else None
    ok = ok and isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], tuple) and len(py[1]) == 625 and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for x in py[1]) and py[1][-1] <= 624
    ok = ok and (py[2] is None or isinstance(py[2], float) and math.isfinite(py[2]))
    npst = got.get("numpy") if ok else None
    ok = ok and isinstance(npst, tuple) and len(npst) == 5 and _eq(npst[0], "MT19937") and isinstance(
        npst[1], np.ndarray) and npst[1].dtype == np.uint32 and npst[1].shape == (624,)
    ok = ok and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in npst[2:4]) and \
        0 <= npst[2] <= 624 and int(npst[3]) in (0, 1) and isinstance(npst[4], float) and math.isfinite(npst[4])
    t = got.get("torch") if ok else None
    if not (ok and isinstance(t, torch.Tensor) and t.dtype == fresh["torch"].dtype and t.shape == fresh["torch"].shape):
        raise _fail(path, "rng", "not the random-number generator states of this python / numpy / torch")


def _bank(got: Any, trainer: Any, path: Path, pool: int) -> None:
    from sara.types import Decision, Rollout

    fields = {f for f in Rollout.__dataclass_fields__}
    groups = got.get("groups") if isinstance(got, Mapping) and set(got) <= {"groups"} else None
    if not isinstance(groups, list):
        raise _fail(path, "bank", "expected {'groups': [...]}")
    for i, g in enumerate(groups):
        at = f"bank.groups[{i}]"
        if not isinstance(g, Mapping) or set(g) != {"group_id", "pool_index", "decision", "metadata", "rollouts"}:
            raise _fail(path, at, "not a banked group")
        _count(g["group_id"], path, f"{at}.group_id")
        _count(g["pool_index"], path, f"{at}.pool_index", most=pool - 1)
        if not any(_eq(g["decision"], int(d)) for d in Decision):
            raise _fail(path, f"{at}.decision", f"{g['decision']!r} is not a decision")
        if not isinstance(g["rollouts"], list) or not g["rollouts"]:
            raise _fail(path, f"{at}.rollouts", "a group holds at least one rollout")
        for j, r in enumerate(g["rollouts"]):
            if not isinstance(r, Mapping) or not set(r) <= fields or not {"prompt_id", "pool_index"} <= set(r):
                raise _fail(path, f"{at}.rollouts[{j}]", "not a rollout")
            _count(r["pool_index"], path, f"{at}.rollouts[{j}].pool_index", most=pool - 1)
            ids, lps = r.get("token_ids"), r.get("logprobs")
            if ids is not None and not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
                raise _fail(path, f"{at}.rollouts[{j}].token_ids", "token ids are whole non-negative numbers")
            if lps is not None and (ids is None or len(lps) != len(ids) or not all(
                    isinstance(x, (int, float)) and math.isfinite(x) for x in lps)):
                raise _fail(path, f"{at}.rollouts[{j}].logprobs", "one finite log-prob per token id")
            if not isinstance(r.get("reward", 0.0), (int, float)) or not math.isfinite(r.get("reward", 0.0)):
                raise _fail(path, f"{at}.rollouts[{j}].reward", "not a finite number")
    _trial(copy.copy(trainer.bank), lambda b: b.load_state_dict(got, trainer.env.prompts), path, "bank", got)


def _trial(obj: Any, load: Any, path: Path, where: str, state: Any) -> None:
    """``load(obj)`` on a throwaway copy: what its own loader refuses is refused here, before the real load; and the
    copy's ``state_dict()`` must then be ``state`` again, value for value (a loader that coerces, ``2.7`` into ``2``
    or ``-1`` into a valid index, would change what the checkpoint says)."""
    try:
        load(obj)
        back = obj.state_dict()
    except Exception as exc:  # noqa: BLE001 - a loader can refuse in any way
        raise _fail(path, where, f"{type(exc).__name__}: {exc}"[:300]) from None
    differs = _differs(state, back, where)
    if differs is not None:
        at, saved, loaded = differs
        raise _fail(path, at, f"{saved!r} would load as {loaded!r}"[:300])


def _differs(a: Any, b: Any, where: str) -> tuple[str, Any, Any] | None:
    """The first place where two states hold different values (lists, tuples and arrays alike; ints equal to floats
    of the same value, but a bool never equal to a number, nor a string to anything else), as ``(where, a's, b's)``;
    None when they agree."""
    if isinstance(a, np.ndarray):
        a = a.tolist()
    if isinstance(b, np.ndarray):
        b = b.tolist()
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        if not (isinstance(a, Mapping) and isinstance(b, Mapping)) or set(a) != set(b):
            return where, "a mapping" if isinstance(a, Mapping) else a, "a mapping" if isinstance(b, Mapping) else b
        for key in a:
            found = _differs(a[key], b[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))) or len(a) != len(b):
            return where, a, b
        for i, (x, y) in enumerate(zip(a, b)):
            found = _differs(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    if isinstance(a, (np.generic,)):
        a = a.item()
    if isinstance(b, (np.generic,)):
        b = b.item()
    same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    kinds = (isinstance(a, str), isinstance(a, bool)) == (isinstance(b, str), isinstance(b, bool))
    return None if same and kinds else (where, a, b)


def validate_state(trainer: Any, path: Path, state: Any) -> None:
    """Check ``state`` against ``trainer``'s own (see the module docstring).

    Raises:
        CheckpointError: naming the file, where in the state, and what is wrong.
    """
    try:
        _validate(trainer, path, state)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a structure no check above foresaw is refused all the same
        raise _fail(path, "state", f"unexpected structure ({type(exc).__name__}: {exc})"[:300]) from None


def _validate(trainer: Any, path: Path, state: Any) -> None:
    fresh = trainer.state_dict()
    if not isinstance(state, Mapping) or set(state) != set(fresh):
        keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise _fail(path, "state", f"expected the keys {sorted(fresh)}, got {keys}"[:300])
    pool = len(trainer.env.prompts)
    c = state["counters"]
    if not isinstance(c, Mapping) or set(c) != set(fresh["counters"]):
        raise _fail(path, "counters", f"expected the keys {sorted(fresh['counters'])}")
    m = _STEP.match(path.name)
    step = _count(c["step"], path, "counters.step", most=int(m.group(1)) if m else None)
    if m and step != int(m.group(1)):
        raise _fail(path, "counters.step", f"{step} but the file is the checkpoint of step {int(m.group(1))}")
    _count(c["version"], path, "counters.version", most=step)
    _number(c["wall_seconds"], path, "counters.wall_seconds")
    totals = state["totals"]
    if not isinstance(totals, Mapping) or not set(totals) <= set(TOTALS):
        raise _fail(path, "totals", f"expected some of the keys {list(TOTALS)}")
    for key, v in totals.items():
        _number(v, path, f"totals.{key}")
    out = state["outcomes"]
    if not isinstance(out, Mapping) or set(out) != {"k", "rows"} or not _eq(out["k"], trainer.config.k) \
            or not isinstance(out["rows"], list):
        raise _fail(path, "outcomes", f"expected {{'k': {trainer.config.k}, 'rows': [...]}}")
    for i, row in enumerate(out["rows"]):
        if not isinstance(row, list) or len(row) not in (4, 5):
            raise _fail(path, f"outcomes.rows[{i}]", "expected [group, n, s, effective, count]")
        *ints, count = row
        g, n, s, e = [0, *ints] if len(ints) == 3 else ints
        for name, v, most in (("group", g, None), ("n", n, trainer.config.k), ("s", s, n), ("effective", e, 1)):
            _count(v, path, f"outcomes.rows[{i}].{name}", most=most if isinstance(most, int) else None)
        _number(count, path, f"outcomes.rows[{i}].count")
    evals = state["evals"]
    if not isinstance(evals, list) or not all(isinstance(e, Mapping) and all(isinstance(k, str) for k in e)
                                              for e in evals):
        raise _fail(path, "evals", "expected a list of {metric: value} records")
    for i, e in enumerate(evals):
        for key, v in e.items():
            _number(v, path, f"evals[{i}].{key}")
    _learner(fresh["learner"], state["learner"], trainer, path)
    alloc = state["allocator"]
    if not isinstance(alloc, Mapping) or not _eq(alloc.get("config"), fresh["allocator"]["config"]):
        raise _fail(path, "allocator.config", "differs from the configured allocator's options")
    astep = alloc.get("step", -1)  # -1 before the first step
    _like({**fresh["allocator"], "step": 0}, {**alloc, "step": 0}, path, "allocator", pool)
    if astep != -1:
        _count(astep, path, "allocator.step", most=step)
    _trial(copy.deepcopy(trainer.allocator), lambda a: a.load_state_dict(alloc), path, "allocator", alloc)
    _like(fresh["sampler"], state["sampler"], path, "sampler", pool)
    _trial(copy.deepcopy(trainer.sampler), lambda s: s.load_state_dict(state["sampler"]), path, "sampler",
           state["sampler"])
    _bank(state["bank"], trainer, path, pool)
    _rng(fresh["rng"], state["rng"], path)


def check_resume(trainer: Any, path: Path, state: Any, *, out: Any = None) -> Any:
    """``compare_config`` then ``validate_state``; prints the notes of changed fields to ``out`` (stderr); returns
    ``state``."""
    notes = compare_config(state.get("config") if isinstance(state, Mapping) else None, trainer.config, path)
    validate_state(trainer, path, state)
    for note in notes:
        print(f"sara: note: {note}", file=out or sys.stderr, flush=True)
    return state

