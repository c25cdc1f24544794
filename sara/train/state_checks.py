"""The value-level checks of a resumed state (``sara.train.resume``): each refuses what it does not expect with a
``CheckpointError`` naming the file, where in the state, and the problem, on one line.

``like`` compares a part with the fresh trainer's own (keys, kinds, shapes, finite non-negative numbers);
``check_learner``, ``check_rng``, ``check_bank`` and ``check_outcomes`` check the parts whose structure a fresh trainer does
not show (weights and optimizer moments, RNG states, banked groups, outcome counts); ``trial_load`` loads a part into a
throwaway copy of its owner and requires the copy to give back exactly the values it was given.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import numpy as np

from sara.train.checkpoint import CheckpointError

if TYPE_CHECKING:
    from sara.envs.task_env import TaskEnv
    from sara.train.bank import SurplusBank
    from sara.train.learner import Learner

__all__ = ["POOL_INDEXED", "check_bank", "check_files", "check_learner", "check_outcomes", "check_rng", "check_values", "equal",
           "fail", "finite", "first_difference", "like", "trial_load", "whole"]

POOL_INDEXED = ("pool_index", "pos")
"""State keys holding a position in the prompt pool (a sampler's position in its pass, a group's prompt)."""


class CheckedTrainer(Protocol):
    """What the checks read of a ``sara.train.Trainer`` (named by its parts: it imports them)."""

    @property
    def learner(self) -> Learner: ...
    @property
    def bank(self) -> SurplusBank: ...
    @property
    def env(self) -> TaskEnv: ...


class GivesState(Protocol):
    """``trial_load``'s copy: part of a trainer that gives its state back (allocator, sampler, bank)."""

    def state_dict(self) -> object: ...


_S = TypeVar("_S", bound=GivesState)


def check_files(files: object, path: Path, names: tuple[str, ...] = ("metrics.jsonl",)) -> None:
    """The run files a checkpoint vouches for (``sara.storage.AppendLog.manifest``): ``{name: {"bytes": whole,
    "sha256": 64 lowercase hex digits}}``, names among ``names``."""
    if not isinstance(files, Mapping) or not set(files) <= set(names):
        raise fail(path, "files", f"expected a mapping with some of the keys {list(names)}")
    for name, entry in files.items():
        if not isinstance(entry, Mapping) or set(entry) != {"bytes", "sha256"}:
            raise fail(path, f"files.{name}", "expected the keys ['bytes', 'sha256']")
        whole(entry["bytes"], path, f"files.{name}.bytes")
        digest = entry["sha256"]
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= set("0123456789abcdef")):
            raise fail(path, f"files.{name}.sha256", f"expected 64 hex digits, got {digest!r}"[:300])


def equal(a: object, b: object) -> bool:
    """Equal, of the same kinds, element by element (arrays and tensors included); never raises."""
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return isinstance(a, Mapping) and isinstance(b, Mapping) and set(a) == set(b) and all(equal(a[k], b[k])
                                                                                               for k in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (type(a) is type(b) and isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))
                and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b)))
    if isinstance(a, (bool, np.bool_)) != isinstance(b, (bool, np.bool_)):
        return False
    scalars = (int, float, str, type(None), np.integer, np.floating, np.bool_)
    if not (isinstance(a, scalars) and isinstance(b, scalars)):
        return False
    try:
        return bool(a == b) or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    except Exception:  # noqa: BLE001
        return False


def fail(path: Path, where: str, problem: str) -> CheckpointError:
    """The error of checkpoint ``path``, at ``where`` in its state, on one line (a value's multi-line repr is folded)."""
    return CheckpointError(" ".join(f"checkpoint {path}: {where}: {problem}".split()))


def whole(value: object, path: Path, where: str, *, most: int | None = None) -> int:
    """A whole non-negative ``int`` (not a bool, not a float), at most ``most``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise fail(path, where, f"expected a whole number, got {type(value).__name__} {value!r}"[:300])
    if value < 0 or (most is not None and value > most):
        raise fail(path, where, f"{value} is out of range [0, {most if most is not None else 'inf'}]")
    return int(value)


def finite(value: object, path: Path, where: str) -> float:
    """A finite non-negative number."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise fail(path, where, f"expected a number, got {type(value).__name__} {value!r}"[:300])
    if not math.isfinite(float(value)) or value < 0:
        raise fail(path, where, f"{value!r} is not a finite non-negative number")
    return float(value)


def like(fresh: object, got: object, path: Path, where: str, pool: int) -> None:
    """``got`` has ``fresh``'s structure where ``fresh`` pins it down (non-empty mappings: the same keys; tuples:
    the same length; scalars: the same kind; arrays: the same dtype kind and rank, and shape when ``fresh`` is
    non-empty), and every number in it is finite and non-negative (pool positions below ``pool``)."""
    if isinstance(fresh, Mapping) and fresh:
        if not isinstance(got, Mapping):
            raise fail(path, where, f"expected a mapping, got {type(got).__name__}")
        missing, extra = sorted(set(fresh) - set(got), key=str), sorted(set(got) - set(fresh), key=str)
        if missing or extra:
            raise fail(path, where, f"missing {missing} / unexpected {extra} keys" if missing and extra else
                        f"missing key {missing[0]!r}" if missing else f"unexpected key {extra[0]!r}")
        for key in fresh:
            like(fresh[key], got[key], path, f"{where}.{key}", pool)
            if key in POOL_INDEXED and isinstance(got[key], (int, np.integer)) and got[key] > pool:
                raise fail(path, f"{where}.{key}", f"{got[key]} is outside the pool of {pool} prompts")
        return
    if isinstance(fresh, list):
        if not isinstance(got, list):
            raise fail(path, where, f"expected a list, got {type(got).__name__}")
        _no_arrays(got, path, where)
    if isinstance(fresh, tuple):
        if not isinstance(got, tuple) or len(got) != len(fresh):
            raise fail(path, where, f"expected a tuple of {len(fresh)}, got {type(got).__name__}")
        for i, (f, g) in enumerate(zip(fresh, got)):
            like(f, g, path, f"{where}[{i}]", pool)
        return
    if isinstance(fresh, np.ndarray):
        if not isinstance(got, np.ndarray) or got.dtype.kind != fresh.dtype.kind or got.ndim != fresh.ndim or (
                fresh.size and got.shape != fresh.shape):
            shape = f"{got.dtype} {got.shape}" if isinstance(got, np.ndarray) else type(got).__name__
            raise fail(path, where, f"expected a {fresh.dtype} array of shape {fresh.shape}, got {shape}")
    elif isinstance(fresh, (bool, np.bool_)):
        if not isinstance(got, (bool, np.bool_)):
            raise fail(path, where, f"expected a bool, got {type(got).__name__} {got!r}"[:300])
    elif isinstance(fresh, (int, np.integer)):
        whole(got, path, where)
    elif isinstance(fresh, (float, np.floating)):
        finite(got, path, where)
    elif isinstance(fresh, str) and not isinstance(got, str):
        raise fail(path, where, f"expected a string, got {type(got).__name__}")
    check_values(got, path, where)


def _leaves(node: Any, where: str) -> Iterator[tuple[Any, str]]:
    """Every value of ``node`` that is not a mapping, list or tuple, with where it sits."""
    stack = [(node, where)]
    while stack:
        x, at = stack.pop()
        if isinstance(x, Mapping):
            stack.extend((v, f"{at}.{k}") for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(x))
        else:
            yield x, at


def _no_arrays(node: list[object], path: Path, where: str) -> None:
    """A list of a state holds what the checkpoint codec writes for it (lists, mappings, numbers, strings), never an
    array: loaded, an array would come back as a list, so the state taken would not be the state saved."""
    for x, at in _leaves(node, where):
        if not isinstance(x, (int, float, str, bool, type(None), np.integer, np.floating, np.bool_)):
            raise fail(path, at, f"expected a list of plain values, found {type(x).__name__}")


def check_values(node: object, path: Path, where: str) -> None:
    """Every number in ``node`` is finite and non-negative (whole where it is an integer)."""
    for x, at in _leaves(node, where):
        if isinstance(x, np.ndarray) and x.dtype.kind in "biuf" and x.size:
            if x.dtype.kind == "f" and not np.isfinite(x).all() or x.dtype.kind in "if" and (x < 0).any():
                raise fail(path, at, "an array holds negative or non-finite values")
        elif isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_)):
            finite(x, path, at)


def check_learner(fresh: Mapping[str, Any], got: object, trainer: CheckedTrainer, path: Path) -> None:
    """The learner: the policy's tensor names, shapes and dtypes (finite); AdamW's moments shaped like their
    parameters, finite, and its hyperparameters those of the config."""
    import torch

    if not isinstance(got, Mapping) or set(got) != set(fresh) or not {"policy", "optimizer"} <= set(fresh):
        raise fail(path, "learner", f"expected the keys {sorted(fresh)}")
    for key in set(fresh) - {"policy", "optimizer", "optimizer_steps"}:
        like(fresh[key], got[key], path, f"learner.{key}", 0)
    weights = got["policy"]
    if not isinstance(weights, Mapping) or set(weights) != set(fresh["policy"]):
        raise fail(path, "learner.policy", "the tensor names differ from this policy's")
    for name, ref in fresh["policy"].items():
        t = weights[name]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            raise fail(path, f"learner.policy.{name}", f"expected a {ref.dtype} tensor of shape {tuple(ref.shape)}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise fail(path, f"learner.policy.{name}", "holds nan or inf")
    if "optimizer_steps" in fresh:
        whole(got["optimizer_steps"], path, "learner.optimizer_steps")
    opt, ref_opt = got["optimizer"], fresh["optimizer"]
    if not isinstance(opt, Mapping) or set(opt) != set(ref_opt) or not isinstance(opt["param_groups"], list) \
            or len(opt["param_groups"]) != len(ref_opt["param_groups"]) or not isinstance(opt["state"], Mapping):
        raise fail(path, "learner.optimizer", "not this optimizer's state (its parameter groups differ)")
    shapes: dict[Any, tuple[int, ...]] = {}
    for i, (g, ref, live) in enumerate(zip(opt["param_groups"], ref_opt["param_groups"],
                                           trainer.learner.optimizer.param_groups)):
        if not isinstance(g, Mapping) or not equal(g.get("params"), ref["params"]):
            raise fail(path, f"learner.optimizer.param_groups[{i}]", "its parameters differ from this policy's")
        for key in set(g) & set(ref) - {"params", "lr", "initial_lr"}:
            if not equal(g[key], ref[key]):
                raise fail(path, f"learner.optimizer.param_groups[{i}].{key}",
                            f"{g[key]!r} differs from the config's {ref[key]!r}"[:300])
        shapes.update({pid: tuple(p.shape) for pid, p in zip(ref["params"], live["params"])})
    for pid, entry in opt["state"].items():
        if pid not in shapes or not isinstance(entry, Mapping):
            raise fail(path, f"learner.optimizer.state[{pid!r}]", "not a parameter of this policy")
        amsgrad = any(g.get("amsgrad") for g in ref_opt["param_groups"])
        keys = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())  # AdamW's moments
        if entry and set(entry) != keys:
            raise fail(path, f"learner.optimizer.state[{pid!r}]", f"expected AdamW's keys {sorted(keys)}")
        for key, t in entry.items():
            scalar = key == "step"  # a whole count; the moments are shaped like the parameter (the squares >= 0)
            ok = isinstance(t, torch.Tensor) and t.is_floating_point() and (
                t.ndim == 0 if scalar else tuple(t.shape) == shapes[pid]) and bool(torch.isfinite(t).all())
            ok = ok and (not scalar or float(t) >= 0 and float(t) == int(t)) and (
                key not in ("exp_avg_sq", "max_exp_avg_sq") or bool((t >= 0).all()))
            if not ok:
                raise fail(path, f"learner.optimizer.state[{pid!r}].{key}",
                           "expected a whole non-negative step count" if scalar else
                           f"expected a finite float tensor of shape {shapes[pid]}"
                           + (", non-negative" if key.endswith("sq") else ""))


def check_outcomes(got: object, k: int, path: Path) -> None:
    """The outcome counts: ``{'k': k, 'rows': [[group, n, s, effective, count], ...]}`` (or the older rows without a
    group), every row of one length and one ``(group, n, s, effective)`` key at most once (a second would silently
    replace the first when loaded), ``s <= n <= k``."""
    if not isinstance(got, Mapping) or set(got) != {"k", "rows"} or not equal(got["k"], k) \
            or not isinstance(got["rows"], list):
        raise fail(path, "outcomes", f"expected {{'k': {k}, 'rows': [...]}}")
    seen: set[tuple[int, ...]] = set()
    for i, row in enumerate(got["rows"]):
        if not isinstance(row, list) or len(row) not in (4, 5) or len(row) != len(got["rows"][0]):
            raise fail(path, f"outcomes.rows[{i}]", "expected [group, n, s, effective, count], as every other row")
        *ints, count = row
        g, n, s, e = [0, *ints] if len(ints) == 3 else ints
        key = tuple(whole(v, path, f"outcomes.rows[{i}].{name}", most=most if isinstance(most, int) else None)
                    for name, v, most in (("group", g, None), ("n", n, k), ("s", s, n), ("effective", e, 1)))
        if key in seen:
            raise fail(path, f"outcomes.rows[{i}]", f"the counts of {key} are given twice")
        seen.add(key)
        finite(count, path, f"outcomes.rows[{i}].count")


def check_rng(fresh: Mapping[str, Any], got: object, path: Path) -> None:
    """The python / numpy / torch random-number generator states, of the sizes those generators take."""
    import torch

    ok = isinstance(got, Mapping) and set(got) == set(fresh)
    py = got.get("python") if ok and isinstance(got, Mapping) else None
    ok = ok and isinstance(py, tuple) and len(py) == 3 and isinstance(py[1], tuple) and len(py[1]) == 625 and all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**32 for x in py[1]) and py[1][-1] <= 624
    ok = ok and isinstance(py, tuple) and (py[2] is None or isinstance(py[2], float) and math.isfinite(py[2]))
    npst = got.get("numpy") if ok and isinstance(got, Mapping) else None
    ok = ok and isinstance(npst, tuple) and len(npst) == 5 and equal(npst[0], "MT19937") and isinstance(
        npst[1], np.ndarray) and npst[1].dtype == np.uint32 and npst[1].shape == (624,)
    ok = ok and isinstance(npst, tuple) and all(
        isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in npst[2:4]) and \
        0 <= npst[2] <= 624 and int(npst[3]) in (0, 1) and isinstance(npst[4], float) and math.isfinite(npst[4])
    t = got.get("torch") if ok and isinstance(got, Mapping) else None
    if not (ok and isinstance(t, torch.Tensor) and t.dtype == fresh["torch"].dtype and t.shape == fresh["torch"].shape):
        raise fail(path, "rng", "not the random-number generator states of this python / numpy / torch")


def check_bank(got: object, trainer: CheckedTrainer, path: Path, pool: int) -> None:
    """The surplus bank: banked groups of rollouts with whole ids, pool indices inside the pool, valid token ids and
    finite log-probs and rewards; then it must load (``trial_load``)."""
    from sara.types import Decision, Rollout

    fields = {f for f in Rollout.__dataclass_fields__}
    groups = got.get("groups") if isinstance(got, Mapping) and set(got) <= {"groups"} else None
    if not isinstance(groups, list):
        raise fail(path, "bank", "expected {'groups': [...]}")
    for i, g in enumerate(groups):
        at = f"bank.groups[{i}]"
        if not isinstance(g, Mapping) or set(g) != {"group_id", "pool_index", "decision", "metadata", "rollouts"}:
            raise fail(path, at, "not a banked group")
        whole(g["group_id"], path, f"{at}.group_id")
        whole(g["pool_index"], path, f"{at}.pool_index", most=pool - 1)
        if not any(equal(g["decision"], int(d)) for d in Decision):
            raise fail(path, f"{at}.decision", f"{g['decision']!r} is not a decision")
        if not isinstance(g["rollouts"], list) or not g["rollouts"]:
            raise fail(path, f"{at}.rollouts", "a group holds at least one rollout")
        for j, r in enumerate(g["rollouts"]):
            if not isinstance(r, Mapping) or not set(r) <= fields or not {"prompt_id", "pool_index"} <= set(r):
                raise fail(path, f"{at}.rollouts[{j}]", "not a rollout")
            whole(r["pool_index"], path, f"{at}.rollouts[{j}].pool_index", most=pool - 1)
            ids, lps = r.get("token_ids"), r.get("logprobs")
            if ids is not None and not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids):
                raise fail(path, f"{at}.rollouts[{j}].token_ids", "token ids are whole non-negative numbers")
            if lps is not None and (ids is None or len(lps) != len(ids) or not all(
                    isinstance(x, (int, float)) and math.isfinite(x) for x in lps)):
                raise fail(path, f"{at}.rollouts[{j}].logprobs", "one finite log-prob per token id")
            if not isinstance(r.get("reward", 0.0), (int, float)) or not math.isfinite(r.get("reward", 0.0)):
                raise fail(path, f"{at}.rollouts[{j}].reward", "not a finite number")
    bank = cast("Mapping[str, Any]", got)  # a mapping: checked above
    trial_load(copy.copy(trainer.bank), lambda b: b.load_state_dict(bank, trainer.env.prompts), path, "bank", got)


def trial_load(obj: _S, load: Callable[[_S], object], path: Path, where: str, state: object) -> None:
    """``load(obj)`` on a throwaway copy: what its own loader refuses is refused here, before the real load; and the
    copy's ``state_dict()`` must then be ``state`` again, value for value (a loader that coerces, ``2.7`` into ``2``
    or ``-1`` into a valid index, would change what the checkpoint says)."""
    try:
        load(obj)
        back = obj.state_dict()
    except Exception as exc:  # noqa: BLE001 - a loader can refuse in any way
        raise fail(path, where, f"{type(exc).__name__}: {exc}"[:300]) from None
    differs = first_difference(state, back, where)
    if differs is not None:
        at, saved, loaded = differs
        raise fail(path, at, f"{saved!r} would load as {loaded!r}"[:300])


def first_difference(a: object, b: object, where: str) -> tuple[str, object, object] | None:
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
            found = first_difference(a[key], b[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))) or len(a) != len(b):
            return where, a, b
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{where}[{i}]")
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
