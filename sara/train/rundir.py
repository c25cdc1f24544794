"""A run directory belongs to one run at a time: ``RunLock`` holds an exclusive lock on ``<out_dir>/.sara.lock``.

Every command that writes a run directory (``sara train``, ``sara matrix``, ``sara bench allocation``) takes it
before it touches anything in it (``sara.commands.output.claim_dir``: ``--overwrite`` deletes a previous run only
while holding it) and hands it on (``Trainer(run_lock=...)``); a ``Trainer`` built without one takes it before it
builds anything (so an unusable ``out_dir`` such as ``/proc/x`` fails at once, with the field named). It is kept until
``close``; a second run on the same directory, in this process or another, gets a one-line ``ConfigError`` naming the
process that holds it. The lock is advisory (``fcntl.flock``): the kernel drops it when the holder exits, even after
SIGKILL, so a crashed run never leaves a stale lock behind.

``--resume`` continues a run or refuses: ``refuse_empty_resume`` stops the resume of a directory that holds a run
but no checkpoint (``NothingToResume``) before anything is built, so the run's files are kept instead of being
overwritten by a fresh start.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sara.config import ConfigError

__all__ = ["LOCK_NAME", "RUN_MARKER", "NothingToResume", "RunLock", "refuse_empty_resume", "releases_run_lock",
           "take_run_lock"]

LOCK_NAME = ".sara.lock"
RUN_MARKER = "metrics.jsonl"
"""The file a training run writes first: a directory that holds it holds a run."""
F = TypeVar("F", bound=Callable[..., Any])


class RunLock:
    """An exclusive, non-blocking lock on a run directory (created with its parents).

    Args:
        directory: The run's output directory.
        field: The config field (or flag) that names it, for error messages.
        what: What reads that field, for error messages.

    Raises:
        ConfigError: the directory cannot be created or written (naming the field and the OS error), or another run
            holds it (naming its pid).
    """

    def __init__(self, directory: str | os.PathLike[str], *, field: str = "out_dir", what: str = "train config") -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fh: Any = None
        where = f"{what}: field '{field}': {str(directory)!r}"
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


class NothingToResume(ConfigError):
    """``--resume`` found a run but no checkpoint it can continue from; the run's files are kept."""


def take_run_lock(directory: str | os.PathLike[str], held: RunLock | None = None, *,
                  resume: bool = False) -> RunLock:
    """``held`` when it is a held lock on ``directory`` (handed on by the command that claimed it), else a new one;
    with ``resume``, a run there must have a checkpoint to continue from (``refuse_empty_resume``).

    Raises:
        ValueError: ``held`` locks another directory.
        ConfigError: as ``RunLock``; ``NothingToResume`` (a lock taken here is released first).
    """
    lock = RunLock(directory) if held is None or not held.held else held
    if lock.directory.resolve() != Path(directory).resolve():
        raise ValueError(f"run_lock holds {lock.directory}, not the run directory {directory}")
    try:
        if resume:
            refuse_empty_resume(directory)
    except BaseException:
        if lock is not held:
            lock.release()
        raise
    return lock


def refuse_empty_resume(directory: str | os.PathLike[str]) -> None:
    """Stop a ``--resume`` of a ``directory`` that holds a run but no checkpoint, before anything is built or
    written (checkpoints that exist but cannot be used are refused by ``sara.train.checkpoint.resume_checkpoint``).

    Raises:
        NothingToResume: naming the directory and the ways out.
    """
    from sara.train.checkpoint import list_checkpoints

    directory = Path(directory)
    if (directory / RUN_MARKER).exists() and not list_checkpoints(directory / "checkpoints"):
        raise NothingToResume(f"--resume: {directory} holds a run but it has no checkpoint (checkpoint_every is 0, "
                              "or it stopped before its first); its files are kept. Pass --overwrite to start it "
                              "over, or --out DIR for a new run")


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
