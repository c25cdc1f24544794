"""Atomic training checkpoints: write to a temp file in the same directory, fsync, then ``os.replace``.

A reader never sees a half-written checkpoint: after a crash (even SIGKILL mid-write) the directory holds the
previous complete checkpoint plus, at worst, a stray ``*.tmp`` file that ``latest_checkpoint`` ignores.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np

from sara.storage import atomic_torch_save

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "checkpoint_path", "rng_state",
           "set_rng_state", "prune_checkpoints"]

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoint_path(directory: str | Path, step: int) -> Path:
    """``directory / "ckpt-000123.pt"``."""
    return Path(directory) / f"ckpt-{step:06d}.pt"


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` (torch-serialisable) to ``path`` atomically; returns the path."""
    return atomic_torch_save(state, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by ``save_checkpoint`` (CPU tensors; trusted local file)."""
    import torch

    return torch.load(Path(path), map_location="cpu", weights_only=False)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``directory`` (None if there is none)."""
    d = Path(directory)
    if not d.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return max(found)[1] if found else None


def prune_checkpoints(directory: str | Path, keep: int) -> None:
    """Delete all but the ``keep`` newest checkpoints in ``directory``."""
    d = Path(directory)
    found = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)))
    for _, p in found[: max(0, len(found) - keep)]:
        p.unlink(missing_ok=True)


def rng_state() -> dict[str, Any]:
    """Global RNG states (python, numpy, torch) for a checkpoint."""
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
