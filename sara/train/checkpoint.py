"""Training checkpoints you can trust: no code runs on load, a torn or altered file is detected, resume falls back.

A checkpoint is two files in ``<out_dir>/checkpoints``:

- ``ckpt-000123.pt``: ``torch.save`` of ``{"format": "sara-checkpoint", "version": 1, "state": <JSON text>,
  "tensors": {name: tensor}}``: the state's structure, counters, allocator / sampler / RNG state as JSON and every
  array as a tensor (``sara.train.codec``; never pickled objects). It loads with ``torch.load(weights_only=True)``,
  which refuses anything but tensors and plain containers, so a file someone hands you cannot run code.
- ``ckpt-000123.pt.sha256``: the completion marker, ``"<sha256>  ckpt-000123.pt"`` (``sha256sum -c`` reads it),
  written after the checkpoint. A checkpoint without it, or whose bytes do not hash to it, is not loaded.

Both are written atomically (temp file, fsync, ``os.replace``): a crash or a full disk leaves the previous checkpoints
intact. ``load_checkpoint`` looks for the marker before it reads the file, hashes it in chunks, and reads it once
(peak memory about its size). ``resume_checkpoint`` returns the newest checkpoint that loads (and passes the caller's
``check``: the trainer validates the whole state, ``sara.train.resume``) and names every newer one it skipped and why.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

from sara.config import ConfigError
from sara.storage import atomic_write, write_point
from sara.train.codec import decode, encode

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path", "rng_state",
           "set_rng_state", "prune_checkpoints", "resume_checkpoint", "list_checkpoints", "CheckpointError",
           "marker_path"]

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
FORMAT, VERSION = "sara-checkpoint", 1


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used (empty, torn, altered, not a sara checkpoint, or refused); names the file."""


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """``directory / "ckpt-000123.pt"``."""
    return Path(directory) / f"ckpt-{step:06d}.pt"


def marker_path(path: str | Path) -> Path:
    """The completion marker of a checkpoint: ``ckpt-000123.pt.sha256``."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` (see ``sara.train.codec`` for what it may hold) and then its marker, both atomically.

    On failure (``OSError``, e.g. a full disk) the error propagates and nothing unverifiable is left behind: every
    older checkpoint is untouched, and a new checkpoint whose marker could not be written is removed.
    """
    import torch

    path = Path(path)
    tree, tensors = encode(state)
    payload = {"format": FORMAT, "version": VERSION, "state": json.dumps(tree, allow_nan=False), "tensors": tensors}
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    marker = marker_path(path)
    atomic_write(path, lambda fh: fh.write(data))  # fails: the old files (even of this step) are untouched
    try:
        atomic_write(marker, lambda fh: fh.write(f"{digest}  {path.name}\n".encode()))
    except BaseException:  # a checkpoint without its marker is not loaded: remove both
        path.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Verify and load a checkpoint written by ``save_checkpoint``; no code in the file is executed.

    Raises:
        CheckpointError: naming the file and what is wrong with it (missing, empty, no completion marker, checksum
            mismatch, refused by the weights-only loader, not a sara checkpoint).
    """
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path}: empty file")
    marker = marker_path(path)
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path}: no completion marker {marker.name} (the write did not finish, "
                              "or the file was not written by this version of sara)")
    with open(marker, "rb") as fh:
        expected = fh.read(256).decode("utf-8", errors="replace").split()[:1]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:  # hashed in chunks: nothing is held in memory
        zipped = fh.read(4) == b"PK\x03\x04"
        fh.seek(0)
        while len(expected) == 1 and (chunk := fh.read(1 << 20)):
            digest.update(chunk)
    if expected != [digest.hexdigest()]:
        raise CheckpointError(f"checkpoint {path}: checksum mismatch with {marker.name} (truncated or modified "
                              "after it was written)")
    try:  # tensors are mapped from the file (the zip format torch.save writes), not copied into memory
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path}: refused by the weights-only loader, it holds pickled objects "
                              f"that would run code ({first})") from None
    except Exception as exc:  # noqa: BLE001 - a corrupt zip / pickle stream surfaces as many types
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT and isinstance(payload.get("state"), str)
            and isinstance(payload.get("tensors"), dict)):
        raise CheckpointError(f"checkpoint {path}: not a {FORMAT} file")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {payload.get('version')!r}, this sara reads "
                              f"{VERSION}")
    try:
        state = decode(json.loads(payload["state"]), payload["tensors"])
        return cast("dict[str, Any]", state)  # what save_checkpoint wrote (--resume checks it before use)
    except RecursionError:
        raise CheckpointError(f"checkpoint {path}: malformed state (nested too deeply)") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointError(f"checkpoint {path}: malformed state ({str(exc)[:300]})") from None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Every ``ckpt-<step>.pt`` in ``directory``, newest (highest step) first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint in ``directory`` whose completion marker is on disk (None if there is none); not
    verified (``resume_checkpoint`` verifies)."""
    return next((p for p in list_checkpoints(directory) if marker_path(p).is_file()), None)


def resume_checkpoint(directory: str | Path, check: Callable[[Path, dict[str, Any]], object] | None = None
                      ) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """The newest checkpoint that verifies, loads and passes ``check``: ``(path, state, skipped)``, ``skipped``
    holding one message per newer checkpoint that did not (each names the file and why). ``(None, None, skipped)``
    when there is none at all, or only checkpoints without their completion marker (writes that never finished).

    Args:
        directory: The checkpoint directory.
        check: ``check(path, state)`` raises ``CheckpointError`` for a state that must be skipped (any other error
            propagates: e.g. a ``ConfigError`` for a run that changed its configuration).

    Raises:
        CheckpointError: complete checkpoints exist but none of them loads (the message lists each and why).
    """
    skipped: list[str] = []
    refused = False  # a checkpoint with its completion marker failed (one without is a write that never finished)
    for path in list_checkpoints(directory):
        try:
            state = load_checkpoint(path)
            if check is not None:
                check(path, state)
            return path, state, skipped
        except CheckpointError as exc:
            skipped.append(str(exc))
            refused = refused or marker_path(path).is_file()
    if refused:
        raise CheckpointError(f"no usable checkpoint in {directory}: " + "; ".join(skipped)
                              + ". Remove them or start a fresh run without --resume")
    return None, None, []


def prune_checkpoints(directory: str | Path, keep: int, *, current: str | Path | None = None) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (with markers) not above ``current`` (the one just
    written, never deleted), with their markers. Files without a marker, and checkpoints of later steps than
    ``current`` (left by another run, or skipped on resume), do not count and are left alone."""
    bound = None if current is None else _step_of(Path(current))
    done = [p for p in list_checkpoints(directory) if marker_path(p).is_file()
            and (bound is None or _step_of(p) <= bound)]
    for p in done[keep:]:
        if current is not None and p.name == Path(current).name:
            continue
        write_point("checkpoint.prune", p)
        p.unlink(missing_ok=True)
        marker_path(p).unlink(missing_ok=True)


def _step_of(path: Path) -> int:
    m = _NAME.match(path.name)
    return int(m.group(1)) if m else -1


def rng_state() -> dict[str, Any]:
    """Global RNG states (python, numpy, torch) for a checkpoint."""
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned (also after a round trip through ``sara.train.codec``)."""
    import torch

    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])

