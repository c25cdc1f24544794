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

A run directory is the run's own: the lock file is opened without following a symbolic link, and a link among the
run's own entries (``own``: ``RUN_FILES`` for a training run, at any depth) is refused when the lock is taken, before
anything is written. ``--overwrite`` retires the previous run in one atomic step (``retire``: the list of its
entries is staged in a new directory, which one ``rename`` makes ``.sara.retired``; the entries are then moved into
it and it is deleted); whoever takes the lock next finishes a retirement a kill interrupted
(``finish_retirement``), so no directory ever holds half of an old run beside a new one. A file of the run that
cannot be written (a full disk) stops the run with ``RunWriteError``, one line naming the file and the checkpoint
the run kept (``write_failed``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sara.config import ConfigError, SaraError
from sara.storage import LogMismatch, atomic_write, fsync_dir, open_nofollow, write_point

__all__ = ["LOCK_NAME", "RETIRED", "RUN_FILES", "RUN_MARKER", "NothingToResume", "RunLock", "RunWriteError",
           "checkpoint_failed", "drop_temp_files", "finish_retirement", "refuse_empty_resume", "refuse_links", "releases_run_lock", "retire",
           "WritesRun", "run_writes", "take_run_lock", "write_failed"]

LOCK_NAME = ".sara.lock"
RUN_MARKER = "metrics.jsonl"
"""The file a training run writes first: a directory that holds it holds a run."""
RUN_FILES = ("metrics.jsonl", "learning_curve.png", "checkpoints", "tb")
"""What a training run writes in its directory (``--overwrite`` retires these first)."""
RETIRED = ".sara.retired"
"""Where a retired run's entries wait to be deleted (``retire``)."""
_STAGING, _NAMES = ".sara.retiring.", ".names.json"
F = TypeVar("F", bound=Callable[..., Any])


class RunLock:
    """An exclusive, non-blocking lock on a run directory (created with its parents).

    Args:
        directory: The run's output directory.
        field: The config field (or flag) that names it, for error messages.
        what: What reads that field, for error messages.
        own: The entries the run writes (``RUN_FILES`` for a training run).

    Raises:
        ConfigError: the directory cannot be created or written (naming the field and the OS error), another run
            holds it (naming its pid), or a symbolic link is among ``own`` (or is the lock file).

    Once the lock is held, a retirement a killed ``--overwrite`` left unfinished is finished (``finish_retirement``),
    the entries ``own`` (names relative to ``directory``) are checked for links (``refuse_links``) and the temp files
    of killed writes among them are deleted (``drop_temp_files``).
    """

    def __init__(self, directory: str | os.PathLike[str], *, field: str = "out_dir", what: str = "train config",
                 own: Sequence[str] = ()) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fh: Any = None
        where = f"{what}: field '{field}': {str(directory)!r}"
        if os.path.islink(self.path):
            raise ConfigError(f"{where}: {self.path} is a symbolic link; a run directory's files are its own and are "
                              "never written through a link: remove it, or give another --out")
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            fh = os.fdopen(open_nofollow(self.path, os.O_RDWR | os.O_CREAT), "r+b")  # held until release()
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
            holder = fh.read(32).decode("ascii", errors="replace").strip() or "unknown"
            fh.close()
            raise ConfigError(f"{where} is in use by another sara run (pid {holder}); give another --out, or wait for "
                              "that run to finish") from None
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n".encode())
            fh.flush()
        except OSError as exc:
            fh.close()
            raise ConfigError(f"{where} cannot be written ({exc.strerror or exc}); give a writable directory "
                              "(--out DIR)") from None
        self._fh = fh
        try:
            finish_retirement(self.directory, where=where)
            refuse_links(self.directory, own, where=where)
            drop_temp_files(self.directory, own)
        except BaseException:
            self.release()
            raise

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
    lock = RunLock(directory, own=RUN_FILES) if held is None or not held.held else held
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
    """Stop a ``--resume`` of a ``directory`` that holds a run but no complete checkpoint (one with its completion
    marker), before anything is built or written (complete checkpoints that cannot be used are refused by
    ``sara.train.checkpoint.resume_checkpoint``).

    Raises:
        NothingToResume: naming the directory and the ways out.
    """
    from sara.train.checkpoint import latest_checkpoint

    directory = Path(directory)
    if (directory / RUN_MARKER).exists() and latest_checkpoint(directory / "checkpoints") is None:
        raise NothingToResume(f"--resume: {directory} holds a run but it has no checkpoint (checkpoint_every is 0, "
                              "or it stopped before its first was complete); its files are kept. Pass --overwrite "
                              "to start it over, or --out DIR for a new run")


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


def refuse_links(directory: str | os.PathLike[str], names: Sequence[str], *, where: str = "run directory") -> None:
    """Refuse a symbolic link among the entries ``names`` of ``directory``, at any depth below them (the directory
    itself and its parents may be links: they are the path the user gave).

    Raises:
        ConfigError: naming the first link found and the way out.
    """
    root = Path(directory)
    for name in names:
        top, found = root / name, None
        if top.is_symlink():
            found = top
        elif top.is_dir():
            for base, dirs, files in os.walk(top):  # never descends into a link
                found = next((Path(base, n) for n in (*dirs, *files) if os.path.islink(os.path.join(base, n))), None)
                if found is not None:
                    break
        if found is not None:
            raise ConfigError(f"{where}: {found} is a symbolic link; a run directory's files are its own and are "
                              "never written through a link: remove it, or give another --out")


def drop_temp_files(directory: str | os.PathLike[str], names: Sequence[str]) -> None:
    """Delete the temp files that writes killed before their rename left (``sara.storage.atomic_write``:
    ``.<name>.*.tmp``) beside the entries ``names`` of ``directory`` and directly inside those that are directories.
    Hold the run lock."""
    root = Path(directory)
    for name in names:
        stray = [*root.glob(f".{name}.*.tmp")]
        if (root / name).is_dir() and not (root / name).is_symlink():
            stray += (root / name).glob(".*.tmp")
        for path in stray:
            if path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)


def retire(directory: str | os.PathLike[str], names: Sequence[str]) -> None:
    """Retire a previous run's entries ``names`` (relative to ``directory``) in one atomic step, then delete them.

    The list of the entries present is written into a new staging directory, which one ``rename`` makes
    ``RETIRED``: from then on the old run is gone, whatever happens. The entries are then moved into it
    (``finish_retirement``) and it is deleted; a kill at any point is finished by whoever takes the run lock next.
    Hold the directory's run lock.
    """
    root = Path(directory)
    present = [n for n in names if os.path.lexists(root / n)]
    if not present:
        return
    staging = Path(tempfile.mkdtemp(dir=root, prefix=_STAGING))
    atomic_write(staging / _NAMES, lambda fh: fh.write(json.dumps(present).encode()))
    write_point("retire.staged", root / RETIRED)
    os.rename(staging, root / RETIRED)  # the one atomic step
    fsync_dir(root)
    finish_retirement(root)


def finish_retirement(directory: str | os.PathLike[str], *, where: str = "run directory") -> None:
    """Finish what ``retire`` began in ``directory``: move the entries its list names aside, delete them, and drop
    staging directories of retirements killed before their atomic step (their run stands). Hold the run lock.

    Raises:
        ConfigError: the retirement's list is damaged (naming it), or it cannot be finished (naming the OS error).
    """
    root = Path(directory)
    trash = root / RETIRED
    try:
        for stale in root.glob(_STAGING + "*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale)
            else:
                stale.unlink()
        if not os.path.lexists(trash):
            return
        if trash.is_symlink() or not trash.is_dir():
            raise ConfigError(f"{where}: {trash} is not a directory sara made; remove it")
        for name in _retired_names(trash, where):
            if os.path.lexists(root / name):
                write_point("retire.move", root / name)
                os.rename(root / name, trash / name)
        fsync_dir(root)
        write_point("retire.delete", trash)
        shutil.rmtree(trash)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot retire the previous run into {trash} ({exc.strerror or exc}); make the "
                          "directory writable, or give another --out") from None


def _retired_names(trash: Path, where: str) -> list[str]:
    """The entries a retirement moves (none when its list is gone: its deletion had begun, every entry moved)."""
    try:
        with open(trash / _NAMES, "rb") as fh:
            names = json.loads(fh.read(1 << 16).decode("utf-8"))
    except FileNotFoundError:
        return []
    except (ValueError, RecursionError):
        names = None
    if not (isinstance(names, list) and all(isinstance(n, str) and n not in ("", ".", "..") and "/" not in n
                                            and "\\" not in n and n not in (_NAMES, LOCK_NAME) for n in names)):
        raise ConfigError(f"{where}: the list of a retired run, {trash / _NAMES}, is damaged; remove {trash} and "
                          "the previous run's files by hand")
    return names


class RunWriteError(SaraError):
    """A file of a run directory could not be written (a full disk, a directory made read-only): one line naming
    the file and what the run kept."""


def write_failed(exc: OSError, *, step: int, checkpoint: str | os.PathLike[str] | None) -> RunWriteError:
    """The ``RunWriteError`` of ``exc`` (its ``filename`` the file that could not be written) after ``step``, naming
    the last good ``checkpoint`` (None: there is none) and the way on."""
    kept = (f"kept: checkpoint {checkpoint}; free space (or make the directory writable) and continue with --resume"
            if checkpoint else "no checkpoint was written (checkpoint_every), so the run cannot be resumed; free "
            "space and start it again with --overwrite")
    return RunWriteError(f"could not write {exc.filename or 'a file of the run directory'} ({exc.strerror or exc}) "
                         f"at step {step}; {kept}")


def checkpoint_failed(path: str | os.PathLike[str], exc: OSError) -> str:
    """The warning of a checkpoint ``path`` that could not be written: the OS error and the checkpoint kept."""
    from sara.train.checkpoint import latest_checkpoint

    prev = latest_checkpoint(Path(path).parent)
    kept = f"the previous checkpoint {prev} is intact" if prev else "there is no earlier checkpoint"
    return f"could not write checkpoint {path} ({exc.strerror or exc}); {kept}"


class WritesRun(Protocol):
    """What ``run_writes`` reads of a ``sara.train.Trainer`` (named by its parts: it imports this module)."""

    @property
    def out_dir(self) -> str | os.PathLike[str]: ...
    @property
    def step(self) -> int: ...
    @property
    def last_checkpoint(self) -> Path | None: ...


@contextlib.contextmanager
def run_writes(trainer: WritesRun) -> Iterator[None]:
    """Around a ``Trainer``'s writes to its run directory: an ``OSError`` on a file inside ``trainer.out_dir`` (a
    full disk, a symbolic link) becomes ``write_failed``'s one-line ``RunWriteError``, and a metrics log that does
    not match what the resumed checkpoint recorded of it (``sara.storage.LogMismatch``) a one-line ``ConfigError``
    that keeps every file."""
    try:
        yield
    except LogMismatch as exc:
        raise ConfigError(f"--resume: {exc}; checkpoint {trainer.last_checkpoint} and the log are kept as they are: "
                          "restore the log, or start the run over with --overwrite") from None
    except OSError as exc:
        out = os.path.abspath(trainer.out_dir)
        if not (exc.filename and os.path.abspath(str(exc.filename)).startswith(out + os.sep)):
            raise
        raise write_failed(exc, step=trainer.step, checkpoint=trainer.last_checkpoint) from None
