"""Default output directories that carry what differs, so commands pasted one after another do not collide.

``sara train`` names its run ``<algo>-<allocator>[@<sampler>]-<task>[-stream][-seed<N>][-<hash>]`` (the hash: of the
other ``--set`` overrides that change the run), or keeps a config's ``name`` and appends the identity fields the
command line sets; ``sara matrix`` and ``sara bench allocation`` append the options that differ from their defaults
(specs as written, ``;`` as ``+``, and a hash of the numeric options) to ``runs/matrix[-quick]`` and
``runs/bench-allocation``. The same command gives the same directory (so ``--resume`` finds it); another command
gives another.
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["slug", "train_run_name", "matrix_out", "bench_allocation_out"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.=@+-]+")
MAX_PART = 60
"""A name part longer than this is cut and ends in a hash of the whole part (names stay short and distinct)."""
IDENTITY = ("algo", "allocator", "sampler", "seed")
"""``TrainConfig`` fields a run's default name shows by value."""
UNNAMED = ("name", "out_dir", "threads", "progress", "tensorboard", "ray.enabled", "ray.num_workers",
           "ray.address")
"""Fields that change where or how fast a run goes, not what it computes: left out of the name's hash."""


def _hash(parts: Iterable[str]) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:6]


def slug(spec: str) -> str:
    """``spec`` as a file-name part: ``;`` becomes ``+``, any run of other characters outside ``[A-Za-z0-9_.=@+-]``
    (``:``, ``,``, ``/``, spaces) one ``-``; longer than ``MAX_PART``, it is cut and ends in a hash of the whole."""
    text = _UNSAFE.sub("-", "+".join(s.strip() for s in str(spec).split(";") if s.strip())).strip("-.") or "x"
    return text if len(text) <= MAX_PART else f"{text[:MAX_PART - 7].rstrip('-.')}-{_hash([text])}"


def _task_part(task: str, default: str) -> str:
    from sara.config import parse_spec

    if task == default:
        return "arithmetic"  # the embedded run's pool (additions)
    name, options = parse_spec(task)
    short = re.sub(r"-v\d+(?=$|#)", "", name.rpartition(":")[2].rpartition("/")[2]).lower()
    return f"{slug(short)}-{_hash([name, *(f'{k}={v}' for k, v in sorted(options.items()))])}"


def _override_keys(overrides: Sequence[str]) -> list[tuple[str, str]]:
    out = []
    for item in overrides:
        key, _, value = item.partition("=")
        out.append((key.strip(), value.strip()))
    return out


def train_run_name(cfg: Any, overrides: Sequence[str]) -> str:
    """The default run name of ``sara train`` for ``cfg`` (a ``TrainConfig``) made with ``overrides``
    (``key=value``, the ``--set`` flags and the flags that become overrides).

    A name the config sets (a file's ``name``, ``--set name=...``) is kept, followed by the values of the
    ``IDENTITY`` fields the overrides set. Otherwise: ``<algo>-<allocator>[@<sampler>]-<task>`` (``arithmetic`` for
    the default pool, else the task's name and a hash of its spec), ``-stream`` for the streaming driver,
    ``-seed<N>`` for a seed other than 0, and a hash of the other overrides that change the run (not ``UNNAMED``).
    """
    from sara.train.config import TrainConfig

    given = _override_keys(overrides)
    if "name" in cfg.model_fields_set:
        name = cfg.name
        for key in dict.fromkeys(key for key, _ in given if key in IDENTITY):
            value = getattr(cfg, key)
            name += f"-seed{value}" if key == "seed" else ("@" if key == "sampler" else "-") + slug(str(value))
        return name
    default_task = TrainConfig.model_fields["task"].default
    name = f"{slug(cfg.algo)}-{slug(cfg.allocator)}"
    if cfg.sampler.strip() != "uniform":
        name += f"@{slug(cfg.sampler)}"
    name += f"-{_task_part(cfg.task, default_task)}"
    if not cfg.driver.barrier:
        name += "-stream"
    if cfg.seed:
        name += f"-seed{cfg.seed}"
    rest = sorted(f"{key}={value}" for key, value in given
                  if key not in (*IDENTITY, "task", "driver", "driver.barrier", *UNNAMED))
    return name + (f"-{_hash(rest)}" if rest else "")


def _defaults(args: argparse.Namespace) -> dict[str, Any]:
    parser = getattr(args, "_parser", None)
    return {} if parser is None else {a.dest: a.default for a in parser._actions}


def _differing(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    defaults = _defaults(args)
    return [n for n in names if n not in defaults or getattr(args, n) != defaults[n]]


def matrix_out(args: argparse.Namespace) -> str:
    """``sara matrix``'s default ``--out``: ``runs/matrix`` (``runs/matrix-quick`` with ``--quick``), then the
    ``--algos`` and ``--allocators`` that differ from the defaults, ``-seeds<N>``, and a hash of every other option
    that changes the matrix (``--steps``, ``--config``, ``--set``, ``--driver``, ``--reference``, ``--target-acc``)."""
    name = "matrix-quick" if args.quick else "matrix"
    for field in _differing(args, ("algos", "allocators")):
        name += f"-{slug(getattr(args, field))}"
    if args.seeds != 1:
        name += f"-seeds{args.seeds}"
    rest = [f"{f}={getattr(args, f)}" for f in _differing(args, ("steps", "config", "driver", "reference",
                                                                  "target_acc"))]
    rest += [f"set {o}" for o in args.overrides if _override_keys([o])[0][0] not in UNNAMED]
    return f"runs/{name}" + (f"-{_hash(rest)}" if rest else "")


def bench_allocation_out(args: argparse.Namespace) -> str:
    """``sara bench allocation``'s default ``--out``: ``runs/bench-allocation``, then the ``--allocators``,
    ``--population`` and ``--sampler`` that differ from the defaults, and a hash of the numeric options that do."""
    name = "bench-allocation"
    for field in _differing(args, ("allocators", "population", "sampler")):
        name += f"-{slug(getattr(args, field))}"
    rest = [f"{f}={getattr(args, f)}" for f in _differing(args, ("k", "target_groups", "seeds", "pool_size", "steps",
                                                                  "pool_epochs", "drift"))]
    return f"runs/{name}" + (f"-{_hash(rest)}" if rest else "")
