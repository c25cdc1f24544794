"""Output conventions shared by the commands: a table on stdout, ``--json FILE`` for machines, progress on stderr,
and run directories that are never overwritten silently.

Every command prints a markdown table (``kv_table`` for a report of named values), writes its JSON report only where
``--json FILE`` says (``write_report``), prints progress lines on stderr while it runs more than a few seconds
(``Ticker`` when the work reports nothing itself), and locks its output directory before it touches it, refusing one
that already holds a run unless ``--overwrite`` is given (``claim_dir``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sara.config import ConfigError
from sara.train.rundir import RETIRED, RunLock, retire

__all__ = ["kv_table", "fmt_value", "check_report_path", "write_report", "claim_dir", "remove_entries", "Ticker",
           "progress"]


def fmt_value(v: Any) -> str:
    """A readable value: integers (and integral floats) with thousands separators, other floats to 4 significant
    digits (``1456.0`` -> ``1,456``; ``0.123456`` -> ``0.1235``), lists joined by ``, ``."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v.is_integer() and abs(v) < 1e15:
            return f"{int(v):,}"
        return f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt_value(x) for x in v)
    return str(v)


def _flatten(report: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in report.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def kv_table(report: Mapping[str, Any], *, title: str = "value") -> str:
    """A two-column markdown table of ``report`` (nested mappings flattened as ``a.b``)."""
    rows = [(k, fmt_value(v)) for k, v in _flatten(report)]
    width = max([len(k) for k, _ in rows] + [len("metric")])
    vwidth = max([len(v) for _, v in rows] + [len(title)])
    lines = [f"| {'metric':<{width}} | {title:<{vwidth}} |", f"|{'-' * (width + 2)}|{'-' * (vwidth + 2)}|"]
    lines += [f"| {k:<{width}} | {v:<{vwidth}} |" for k, v in rows]
    return "\n".join(lines)


def check_report_path(path: str | Path | None, *, flag: str = "--json") -> None:
    """Refuse, before any work starts, a report path that cannot be written: a directory, or a path whose nearest
    existing parent is not a directory this process can create files in (checked by creating and removing one).

    Raises:
        ConfigError: naming the flag, the path and why.
    """
    if not path:
        return
    out = Path(path)
    why = "it is a directory" if out.is_dir() else None
    parent = out.parent
    while why is None and not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if why is None and not parent.is_dir():
        why = f"{parent} is not a directory"
    if why is None:
        try:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".sara-probe.")
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            why = f"no file can be created in {parent} ({exc.strerror or exc})"
    if why:
        raise ConfigError(f"{flag} {str(path)!r} cannot be written: {why}; give a writable file path")


def write_report(report: Mapping[str, Any], path: str | Path | None, *, kept: str = "") -> Path | None:
    """Write ``report`` as JSON to ``path`` atomically (parents created), say so on stdout, return the path; None
    when ``path`` is None.

    Raises:
        RunWriteError: the file cannot be written (a full disk), one line naming it and ``kept`` (what the command
            already wrote elsewhere).
    """
    if not path:
        return None
    from sara.storage import atomic_write
    from sara.train.rundir import RunWriteError

    out = Path(path)
    text = json.dumps(report, indent=2) + "\n"
    try:
        atomic_write(out, lambda fh: fh.write(text.encode()))
    except OSError as exc:
        raise RunWriteError(f"could not write the JSON report {out} ({exc.strerror or exc})"
                            + (f"; {kept}" if kept else "")) from None
    print(f"\nJSON: {out}")
    return out


def claim_dir(path: str | Path, *, overwrite: bool, marker: str, what: str, replace: Sequence[str] = (),
              resume_hint: bool = False, resume: bool = False, field: str = "--out",
              config: str | None = None) -> RunLock:
    """The output directory ``path``, locked for this run and made ready for it.

    The run lock (``sara.train.rundir.RunLock``) is taken first, before anything is looked at or removed: a
    directory another run holds is a ``ConfigError`` naming its pid, and nothing in it is touched. A directory that
    already holds ``marker`` (the file a run writes first, e.g. ``metrics.jsonl``) is a previous run: without
    ``overwrite`` a ``ConfigError`` names it and the ways out; with it, the previous run's ``replace`` entries
    (files or directories, e.g. ``checkpoints``) are retired in one atomic step (``sara.train.rundir.retire``), so
    none of them outlives it, even when a kill interrupts the retirement. With ``resume`` the previous run is kept
    and must be there (else a ``ConfigError``, and a missing directory is not created). The ``replace`` entries are
    the run's own: a symbolic link among them is refused. Nothing else in the directory is touched.

    Args:
        path: The run directory.
        overwrite: Replace a previous run (``--overwrite``).
        marker: The file name (relative to ``path``) whose presence means a run is there.
        what: The command, for the message (``"sara train"``).
        replace: What a previous run wrote that the new one must not inherit (relative to ``path``).
        resume_hint: Also suggest ``--resume``.
        resume: Continue the previous run (``--resume``): nothing is removed.
        field: The flag or config field that names ``path``, for the lock's messages.
        config: The config ``field`` belongs to, for the lock's messages (default: ``what``).

    Returns:
        The held lock (``.directory`` is ``path``); release it, or hand it to the ``Trainer``, when the run ends.
    """
    out = Path(path)
    if resume and not (out / marker).exists() and not (out / RETIRED).is_dir():  # before the lock, which would
        # create the directory (an unfinished retirement is finished by the lock, below)
        raise ConfigError(f"{what}: --resume: {out} holds no run to continue (no {marker}); drop --resume to start "
                          "one there")
    lock = RunLock(out, field=field, what=config or what, own=replace)
    try:
        if resume and not (out / marker).exists():  # a retirement the lock finished took it
            raise ConfigError(f"{what}: --resume: {out} holds no run to continue (no {marker}); drop --resume to "
                              "start one there")
        if resume or not os.path.lexists(out / marker):
            return lock
        if not overwrite:
            hint = ", --resume to continue it" if resume_hint else ""
            raise ConfigError(f"{what}: {out} already holds a run ({out / marker}); pass --overwrite to replace it"
                              f"{hint}, or --out DIR for a new one")
        retire(out, replace)
    except BaseException:
        lock.release()
        raise
    return lock


def remove_entries(directory: str | Path, names: Sequence[str]) -> None:
    """Remove ``names`` (files or directories, relative to ``directory``) where they exist, in one atomic step
    (``sara.train.rundir.retire``); hold its run lock."""
    retire(directory, names)


def progress(tag: str, message: str) -> None:
    """One progress line on stderr: ``[tag] message``."""
    print(f"[{tag}] {message}", file=sys.stderr, flush=True)


class Ticker:
    """While the ``with`` block runs, print ``[tag] running, N s`` on stderr every ``every`` seconds (for work that
    reports no progress itself), followed by ``; <detail()>`` when ``detail`` gives a non-empty text."""

    def __init__(self, tag: str, every: float = 10.0, detail: Callable[[], str] | None = None) -> None:
        self.tag, self.every, self.detail = tag, every, detail
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            extra = self.detail() if self.detail is not None else ""
            progress(self.tag, f"running, {time.perf_counter() - self._t0:.0f} s" + (f"; {extra}" if extra else ""))

    def __enter__(self) -> Ticker:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
