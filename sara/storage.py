"""Files on disk: the cache root, an advisory file lock, and atomic writes.

One place for what checkpoints, warm-start caches and prepared models all need: a reader never sees a half-written
file (write to a temp file in the same directory, fsync, ``os.replace``), and parallel processes build a cached
artifact once (``file_lock``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["cache_root", "file_lock", "atomic_write", "atomic_torch_save"]


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$SARA_CACHE_DIR``, else ``~/.cache/sara``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SARA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sara"


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (created with its parents), so parallel processes build a cached
    artifact once and the others wait; a no-op where ``fcntl`` is missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> Path:
    """Call ``write(fh)`` on a temp file beside ``path``, fsync it, then ``os.replace`` it onto ``path``.

    A crash (even SIGKILL) leaves the previous ``path`` intact plus, at worst, a stray ``.<name>.*.tmp`` file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (see ``atomic_write``)."""
    import torch

    return atomic_write(path, lambda fh: torch.save(obj, fh))
