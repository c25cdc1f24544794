"""A run directory belongs to one run at a time: ``RunLock`` holds an exclusive lock on ``<out_dir>/.sara.lock``.

A ``Trainer`` takes it before it builds anything (so an unusable ``out_dir`` such as ``/proc/x`` fails at once, with
the field named) and keeps it until ``close``; a second run on the same directory, in this process or another, gets a
one-line ``ConfigError`` naming the process that holds it. The lock is advisory (``fcntl.flock``): the kernel drops
it when the holder exits, even after SIGKILL, so a crashed run never leaves a stale lock behind.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sara.config import ConfigError

__all__ = ["LOCK_NAME", "RunLock", "releases_run_lock"]

LOCK_NAME = ".sara.lock"
F = TypeVar("F", bound=Callable[..., Any])


class RunLock:
    """An exclusive, non-blocking lock on a run directory (created with its parents).

    Args:
        directory: The run's output directory.
        field: The config field that names it, for error messages.

    Raises:
        ConfigError: the directory cannot be created or written (naming the field and the OS error), or another run
            holds it (naming its pid).
    """

    def __init__(self, directory: str | os.PathLike[str], *, field: str = "out_dir") -> None:
        self.path = Path(directory) / LOCK_NAME
        self._fh: Any = None
        where = f"train config: field '{field}': {str(directory)!r}"
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            fh = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 - held until release()
        except OSError as exc:
            raise ConfigError(f"{where} cannot be used as a run directory ({exc.strerror or exc}); give a writable "
                              "directory (--out DIR)") from None
        try:
            import fcntl
        except ImportError:  # pragma: no cover - non-POSIX: no lock
            self._fh = fh
            return
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):  # e.g. no locks on this filesystem
                self._fh = fh
                return
            fh.seek(0)
            holder = fh.read(32).strip() or "unknown"
            fh.close()
            raise ConfigError(f"{where} is in use by another sara run (pid {holder}); give another --out, or wait for "
                              "that run to finish") from None
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n")
            fh.flush()
        except OSError as exc:
            fh.close()
            raise ConfigError(f"{where} cannot be written ({exc.strerror or exc}); give a writable directory "
                              "(--out DIR)") from None
        self._fh = fh

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fh is not None

    def release(self) -> None:
        """Give the directory up (idempotent)."""
        fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()  # closing the file drops the flock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def releases_run_lock(init: F) -> F:
    """Decorator of an ``__init__`` that takes a ``RunLock`` into ``self._run_lock``: when the rest of ``__init__``
    raises, the lock is released before the error propagates (a half-built object keeps no directory)."""

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            lock = getattr(self, "_run_lock", None)
            if lock is not None:
                lock.release()
            raise

    return wrapper  # type: ignore[return-value]
