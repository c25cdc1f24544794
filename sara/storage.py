"""Files on disk: the cache root, an advisory file lock, atomic writes, append-only logs and verified cache entries.

One place for what run directories, checkpoints, warm-start caches and prepared models all need: a reader never sees
a half-written file (``atomic_write``: a temp file in the same directory, fsync, ``os.replace``, fsync of the
directory), a log is only ever appended to and cut back to a length its writer vouched for (``AppendLog``: a torn
tail is dropped, the kept bytes are checked against their sha256), parallel processes build a cached artifact once
(``file_lock``), and a cache entry is used only when it hashes to the checksum written beside it (``write_verified``
/ ``load_verified``): a truncated, altered or unloadable entry is removed with a one-line notice naming the file, and
the caller recomputes it.

Each step of these writes is a named write point (``write_point``); ``on_write_point`` installs a hook called there,
which tests use to fail or kill the process between any two steps.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

__all__ = ["cache_root", "file_lock", "atomic_write", "atomic_torch_save", "BadCacheEntry", "checksum_path",
           "file_sha256", "write_verified", "load_verified", "directory_checksums", "verify_directory", "AppendLog",
           "LogMismatch", "WRITE_POINTS", "write_point", "on_write_point", "open_nofollow", "fsync_dir"]

T = TypeVar("T")

WRITE_POINTS = ("atomic.temp", "atomic.rename", "log.append", "log.cut", "retire.staged", "retire.move",
                "retire.delete", "checkpoint.prune")
"""The named write points: a temp file written and fsynced but not yet renamed onto its path; renamed, its directory
not yet fsynced; a log record about to be appended; a log about to be cut back on resume; an old run's retirement
staged but not yet made (``sara.train.rundir.retire``); an entry of it about to be moved aside; the moved entries
about to be deleted; an old checkpoint about to be pruned."""

_HOOK: Callable[[str, Path], None] | None = None


def write_point(name: str, path: str | os.PathLike[str]) -> None:
    """Mark the named write point ``name`` (one of ``WRITE_POINTS``) of a write to ``path``: calls the hook that
    ``on_write_point`` installed, if any."""
    if _HOOK is not None:
        _HOOK(name, Path(path))


@contextlib.contextmanager
def on_write_point(hook: Callable[[str, Path], None]) -> Iterator[None]:
    """Call ``hook(name, path)`` at every write point while the ``with`` block runs (the hook may raise, or kill the
    process, to test what each interrupted write leaves behind)."""
    global _HOOK
    previous, _HOOK = _HOOK, hook
    try:
        yield
    finally:
        _HOOK = previous


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory, so a rename or a new file in it survives a power loss (a no-op where not supported)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC)``: a symbolic link at ``path`` raises ``OSError`` (ELOOP)
    instead of being followed."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.EMLINK and os.path.islink(path)):  # EMLINK: FreeBSD
            raise OSError(errno.ELOOP, "is a symbolic link, which a run directory does not follow", str(path)) \
                from None
        raise


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
    """Call ``write(fh)`` on a temp file beside ``path``, fsync it, ``os.replace`` it onto ``path``, fsync the
    directory.

    A crash (even SIGKILL) leaves the previous ``path`` intact plus, at worst, a stray ``.<name>.*.tmp`` file; a
    failed write leaves the previous ``path``, removes the temp file and raises ``OSError`` with ``filename`` set to
    ``path`` (e.g. a full disk, whichever call hit it). A symbolic link at ``path`` is replaced, never followed (the
    temp file is created with ``O_EXCL``).
    """
    path = Path(path)
    tmp = ""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        write_point("atomic.temp", path)
        os.replace(tmp, path)
        write_point("atomic.rename", path)
        fsync_dir(path.parent)
    except OSError as exc:  # named by the file it was writing (a writer's own error may name none, or the temp file)
        if exc.filename == str(path):
            raise
        raise type(exc)(exc.errno, exc.strerror or str(exc), str(path)) from exc
    finally:
        if tmp and os.path.lexists(tmp):
            os.unlink(tmp)
    return path


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (see ``atomic_write``)."""
    import torch

    return atomic_write(path, lambda fh: torch.save(obj, fh))


class BadCacheEntry(Exception):
    """Raised by a ``load_verified`` loader: the entry's bytes are intact but its content is unusable (e.g.
    non-finite weights); the message says what is wrong and completes "cache entry <path> ..."."""


def checksum_path(path: str | os.PathLike[str]) -> Path:
    """The checksum file of a cache entry: ``<path>.sha256`` (``"<sha256>  <name>"``, as ``sha256sum`` writes)."""
    path = Path(path)
    return path.with_name(path.name + ".sha256")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_verified(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` and then its checksum file, both atomically (a crash between the two leaves an
    entry that ``load_verified`` refuses)."""
    path = Path(path)
    digest = hashlib.sha256(data).hexdigest()
    atomic_write(path, lambda fh: fh.write(data))
    atomic_write(checksum_path(path), lambda fh: fh.write(f"{digest}  {path.name}\n".encode()))
    return path


def _checksum_problem(path: Path) -> str | None:
    marker = checksum_path(path)
    if not marker.is_file():
        return f"has no checksum file {marker.name} (written by an earlier sara, or its write did not finish)"
    with open(marker, "rb") as fh:
        expected = fh.read(256).decode("utf-8", errors="replace").split()[:1]
    if expected != [file_sha256(path)]:
        return f"does not match its checksum in {marker.name} (truncated or modified after it was written)"
    return None


def load_verified(path: str | os.PathLike[str], load: Callable[[Path], T]) -> T | None:
    """A cache entry written by ``write_verified``, loaded by ``load(path)``; None when there is none to use.

    An entry without its checksum file, one whose bytes do not hash to it, one ``load`` cannot read, and one whose
    ``load`` raises ``BadCacheEntry`` are removed (with the checksum file), after one line on stderr naming the file
    and what is wrong; the caller then recomputes it. Hold the entry's ``file_lock`` around this and the rewrite.
    """
    path = Path(path)
    if not path.exists():
        return None
    problem = _checksum_problem(path)
    if problem is None:
        try:
            return load(path)
        except BadCacheEntry as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - a corrupt file surfaces as many error types
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            problem = f"cannot be read ({type(exc).__name__}: {first})"
    print(f"sara: note: cache entry {path} {problem}; recomputing it", file=sys.stderr, flush=True)
    path.unlink(missing_ok=True)
    checksum_path(path).unlink(missing_ok=True)
    return None


_VERIFIED: dict[str, tuple[tuple[tuple[str, int, int], ...], bool]] = {}  # directory -> (file stats, intact)


def directory_checksums(directory: str | os.PathLike[str], *, exclude: str = "") -> dict[str, str]:
    """``{relative path: sha256}`` of every file under ``directory`` (but ``exclude``)."""
    root = Path(directory)
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != exclude}


def verify_directory(marker: str | os.PathLike[str]) -> bool:
    """Whether the directory of ``marker`` (a JSON object written last into a cached directory) is intact.

    The marker's ``"files"`` maps each file to its sha256 (``directory_checksums``); every one must be there and
    hash to it (checked, and a failure named, once per process while the files' sizes and times stay the same). A
    marker without ``"files"`` (written by an earlier sara) gets them recorded now, with a note. A missing,
    truncated or modified file, or an unreadable marker, is one line on stderr naming the file, and False: the
    caller rebuilds it.
    """
    import json

    marker = Path(marker)
    root = marker.parent
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
        files = meta.get("files") if isinstance(meta, dict) else None
    except (OSError, ValueError):
        meta, files = None, None
    if not isinstance(meta, dict) or not isinstance(files, (dict, type(None))):
        print(f"sara: note: cache entry {marker} is not readable; recomputing it", file=sys.stderr, flush=True)
        return False
    if files is None:
        meta["files"] = directory_checksums(root, exclude=marker.name)
        try:
            atomic_write(marker, lambda fh: fh.write((json.dumps(meta, indent=2) + "\n").encode()))
        except OSError:  # a read-only cache: used as it is
            return True
        print(f"sara: note: recorded the checksums of {root} (prepared by an earlier sara)", file=sys.stderr,
              flush=True)
        return True
    stats = []
    for name in sorted(files):
        st = (root / name).stat() if (root / name).is_file() else None
        stats.append((name, st.st_size if st else -1, st.st_mtime_ns if st else -1))
    seen = _VERIFIED.get(str(root))
    if seen is not None and seen[0] == tuple(stats):
        return seen[1]
    ok = True
    for (name, size, _), digest in zip(stats, (files[n] for n in sorted(files))):
        problem = ("is missing" if size < 0 else None if file_sha256(root / name) == digest else
                   f"does not match its checksum in {marker.name} (truncated or modified after it was written)")
        if problem:
            print(f"sara: note: cache entry {root / name} {problem}; recomputing it", file=sys.stderr, flush=True)
            ok = False
            break
    _VERIFIED[str(root)] = (tuple(stats), ok)
    return ok


class LogMismatch(Exception):
    """An ``AppendLog`` does not begin with the bytes its manifest names (truncated, damaged or modified since); the
    message names the file and what differs."""


class AppendLog:
    """A log of text lines that is only ever appended to, or cut back to a length its writer vouched for.

    Each line goes to the file in one ``write`` (``O_APPEND``, the file opened without following a symbolic link);
    the log keeps the length and sha256 of what it wrote (``manifest``), which a checkpoint records. Reopened with
    that manifest, the file must begin with exactly those bytes (else ``LogMismatch``), and whatever follows them
    (lines written after the checkpoint, a torn last line of a killed writer) is cut off with one ``ftruncate``:
    nothing before the manifest's length is ever rewritten.

    Args:
        path: The log file.
        resume: ``None``: start a new, empty log (atomically replacing whatever ``path`` holds); else a ``manifest``
            of this log to continue from.

    Raises:
        LogMismatch: ``resume`` is given and the file does not match it.
        OSError: the file cannot be created, opened (a symbolic link: ``ELOOP``) or read.
    """

    def __init__(self, path: str | os.PathLike[str], resume: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        if resume is None:
            atomic_write(self.path, lambda fh: None)
        self._fd = open_nofollow(self.path, os.O_RDWR | os.O_APPEND)
        self._sha, self.bytes = hashlib.sha256(), 0
        try:
            if resume is not None:
                self._continue(int(resume["bytes"]), str(resume["sha256"]))
        except BaseException:
            os.close(self._fd)
            raise

    def _continue(self, size: int, digest: str) -> None:
        have = os.fstat(self._fd).st_size
        if have < size:
            raise LogMismatch(f"{self.path} holds {have:,} bytes, fewer than the {size:,} its checkpoint recorded "
                              "(truncated or replaced since)")
        os.lseek(self._fd, 0, os.SEEK_SET)
        left = size
        while left and (chunk := os.read(self._fd, min(left, 1 << 20))):
            self._sha.update(chunk)
            left -= len(chunk)
        if left or self._sha.hexdigest() != digest:
            raise LogMismatch(f"the first {size:,} bytes of {self.path} do not hash to the sha256 its checkpoint "
                              "recorded (damaged or modified since)")
        self.bytes = size
        if have > size:  # lines logged after the checkpoint, or a torn last line: they are written again
            write_point("log.cut", self.path)
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)

    def append(self, line: str) -> None:
        """Append ``line`` and a newline. On ``OSError`` (a full disk) the part that was written is cut off again
        where possible, and the error propagates with ``filename`` set to the log."""
        data = (line + "\n").encode("utf-8")
        done = 0
        try:
            write_point("log.append", self.path)
            while done < len(data):
                done += os.write(self._fd, data[done:])
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.bytes)
            raise type(exc)(exc.errno, exc.strerror or str(exc), str(self.path)) from exc
        self._sha.update(data)
        self.bytes += len(data)

    def manifest(self) -> dict[str, Any]:
        """``{"bytes": length, "sha256": digest}`` of what was written, made durable first (fsync)."""
        if self._fd is not None:
            os.fsync(self._fd)
        return {"bytes": self.bytes, "sha256": self._sha.hexdigest()}

    def close(self) -> None:
        """Close the file (idempotent); ``manifest`` still answers."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
