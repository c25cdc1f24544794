"""Batch scoring of untrusted completions with a per-call time limit.

``BatchScorer(verifier, mode=..., timeout_s=...)`` scores many ``(completion, answer_fields)`` pairs. Whatever a
verifier does, scoring never raises: a call that raises, returns something that is not a finite number (or ``None``),
or runs past ``timeout_s`` gets reward 0 and is counted (``ScoreResult.status`` per item, ``metrics()`` in total).

Modes:
    ``"thread"``: calls run one after another in a helper thread that the caller watches; a call past its limit is
        abandoned (Python cannot kill a thread: it keeps running in the background until it returns, so use this only
        for verifiers that bound their own work, as the built-in ones do) and the rest of the batch continues in a
        fresh helper thread.
    ``"process"``: calls run in persistent worker processes (``workers`` of them); a worker past its limit is killed
        and replaced. Use it for verifiers that are not thread-safe or may hang: math-verify's own timeouts use
        ``signal.alarm``, which only works in a main thread (each worker's calls run in its main thread). The verifier
        must be picklable (a module-level function or a ``functools.partial`` of one), and scripts need the usual
        ``if __name__ == "__main__":`` guard of ``multiprocessing``'s spawn start method.
    ``"inline"``: plain calls in the caller's thread, exceptions caught, no time limit (tests, trusted verifiers).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any, Literal

import numpy as np

__all__ = ["BatchScorer", "ScoreResult", "OK", "NOT_APPLICABLE", "ERROR", "TIMEOUT", "score_batch"]

OK, NOT_APPLICABLE, ERROR, TIMEOUT = 0, 1, 2, 3
"""Per-item status codes of ``ScoreResult.status``."""

Mode = Literal["thread", "process", "inline"]
_MAX_ERRORS_KEPT = 8
_BOOT_TIMEOUT_S = 120.0
_BOOT_ERROR = ("BatchScorer: a verifier worker did not start (is the verifier picklable, and is the script guarded by "
               "if __name__ == '__main__'?)")


@dataclass(frozen=True)
class ScoreResult:
    """Scores of one batch.

    Attributes:
        rewards: ``[n]`` float64; 0.0 wherever ``status != OK``.
        status: ``[n]`` int8: ``OK``, ``NOT_APPLICABLE`` (the verifier returned ``None``), ``ERROR`` (it raised, or
            returned a non-number / NaN / inf, or its worker died) or ``TIMEOUT``.
        errors: The first few error messages, for logs.
    """

    rewards: np.ndarray
    status: np.ndarray
    errors: tuple[str, ...] = ()

    @property
    def num_errors(self) -> int:
        return int(np.count_nonzero(self.status == ERROR))

    @property
    def num_timeouts(self) -> int:
        return int(np.count_nonzero(self.status == TIMEOUT))

    @property
    def num_not_applicable(self) -> int:
        return int(np.count_nonzero(self.status == NOT_APPLICABLE))


def _coerce(value: Any) -> tuple[int, float | str]:
    """Verifier output -> (status, reward or error message)."""
    if value is None:
        return NOT_APPLICABLE, 0.0
    if isinstance(value, (bool, int, float, np.bool_, np.integer, np.floating)):
        try:
            x = float(value)
        except OverflowError:
            return ERROR, "verifier returned an integer too large for a float"
        if math.isfinite(x):
            return OK, x
        return ERROR, f"verifier returned a non-finite reward {x!r}"
    return ERROR, f"verifier returned {type(value).__name__}, expected float | None"


def _call(verifier: Callable[..., Any], completion: str, answer: Mapping[str, Any]) -> tuple[int, float | str]:
    try:
        return _coerce(verifier(completion, **answer))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # untrusted input: any failure (even SystemExit) is a 0 reward, counted
        return ERROR, f"{type(exc).__name__}: {str(exc)[:200]}"


class _ThreadRun:
    """Scores items ``start..n-1`` sequentially in a helper thread, publishing progress for the watcher."""

    def __init__(self, verifier: Callable[..., Any], completions: Sequence[str], answers: Sequence[Mapping[str, Any]],
                 start: int, status: np.ndarray, values: list[float | str]) -> None:
        self.verifier, self.completions, self.answers = verifier, completions, answers
        self.status, self.values = status, values
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.pos = start
        self.item_start = time.monotonic()
        self.abandoned = False

    def run(self) -> None:
        for i in range(self.pos, len(self.completions)):
            with self.lock:
                if self.abandoned:
                    return
                self.pos, self.item_start = i, time.monotonic()
            st, v = _call(self.verifier, self.completions[i], self.answers[i])
            with self.lock:
                if self.abandoned:
                    return
                self.status[i], self.values[i] = st, v
        with self.lock:
            self.pos = len(self.completions)
        self.done.set()


def _worker_main(conn: Connection, verifier: Callable[..., Any]) -> None:
    """Worker process loop: ``(index, completion, answer)`` in, ``(index, status, value)`` out; ``None`` stops."""
    conn.send("ready")  # the verifier is unpickled (its module imported): item timing can start
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, completion, answer = msg
        conn.send((idx, *_call(verifier, completion, answer)))


class _Worker:
    def __init__(self, ctx: Any, verifier: Callable[..., Any]) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, verifier), daemon=True, name="sara-verifier")
        self.proc.start()
        child.close()
        self.item: int | None = None
        self.started = 0.0
        self.born = time.monotonic()
        self.ready = False

    def wait_ready(self, timeout: float) -> bool:
        """Block until the worker has imported the verifier (not counted in any call's time limit)."""
        if not self.ready:
            try:
                self.ready = self.conn.poll(timeout) and self.conn.recv() == "ready"
            except (EOFError, OSError):
                self.ready = False
        return self.ready

    def submit(self, idx: int, completion: str, answer: Mapping[str, Any]) -> None:
        self.item, self.started = idx, time.monotonic()
        self.conn.send((idx, completion, dict(answer)))

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(timeout=5)
        finally:
            self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.proc.join(timeout=2)
        except (OSError, ValueError, BrokenPipeError):
            pass
        if self.proc.is_alive():
            self.kill()
        else:
            self.conn.close()


class BatchScorer:
    """Scores batches of completions with one verifier, safely (see the module docstring).

    Args:
        verifier: ``verify(completion, **answer_fields) -> float | None``.
        mode: ``"thread"``, ``"process"`` or ``"inline"``.
        timeout_s: Per-call time limit in seconds (``thread`` and ``process`` modes).
        workers: Worker processes (``process`` mode); default ``min(2, cpu_count)``.
        mp_context: ``multiprocessing`` start method for workers (``"spawn"`` is safe in processes that run threads,
            e.g. torch or Ray; ``"forkserver"`` restarts faster).
    """

    def __init__(self, verifier: Callable[..., Any], *, mode: Mode = "thread", timeout_s: float = 1.0,
                 workers: int | None = None, mp_context: str = "spawn") -> None:
        if mode not in ("thread", "process", "inline"):
            raise ValueError(f"BatchScorer: field 'mode' must be 'thread', 'process' or 'inline', got {mode!r}")
        if not timeout_s > 0:
            raise ValueError(f"BatchScorer: field 'timeout_s' must be > 0, got {timeout_s!r}")
        if not callable(verifier):
            raise TypeError("BatchScorer: verifier must be callable")
        self.verifier = verifier
        self.mode: Mode = mode
        self.timeout_s = float(timeout_s)
        self.num_workers = max(1, workers if workers is not None else min(2, os.cpu_count() or 1))
        self._ctx = mp.get_context(mp_context) if mode == "process" else None
        self._workers: list[_Worker] = []
        self._counts = {"calls": 0, "errors": 0, "timeouts": 0, "not_applicable": 0, "worker_restarts": 0}
        self._seconds = 0.0

    # ------------------------------------------------------------------ public
    def score(self, completions: Sequence[str], answers: Sequence[Mapping[str, Any]]) -> ScoreResult:
        """Score ``completions[i]`` against ``answers[i]`` (keyword arguments of the verifier)."""
        if len(completions) != len(answers):
            raise ValueError(f"BatchScorer.score: {len(completions)} completions but {len(answers)} answers")
        n = len(completions)
        status = np.full(n, ERROR, np.int8)
        values: list[float | str] = [0.0] * n
        t0 = time.perf_counter()
        if n:
            if self.mode == "inline":
                for i in range(n):
                    status[i], values[i] = _call(self.verifier, completions[i], answers[i])
            elif self.mode == "thread":
                self._score_threaded(completions, answers, status, values)
            else:
                self._score_processes(completions, answers, status, values)
        self._seconds += time.perf_counter() - t0
        ok = status == OK
        rewards = np.array([v if s == OK else 0.0 for v, s in zip(values, status)], np.float64)
        rewards[~ok] = 0.0
        errors = tuple(str(v) for v, s in zip(values, status) if s == ERROR)[:_MAX_ERRORS_KEPT]
        result = ScoreResult(rewards=rewards, status=status, errors=errors)
        self._counts["calls"] += n
        self._counts["errors"] += result.num_errors
        self._counts["timeouts"] += result.num_timeouts
        self._counts["not_applicable"] += result.num_not_applicable
        return result

    def metrics(self, prefix: str = "verifier/") -> dict[str, float]:
        """Cumulative counters: calls, errors, timeouts, not_applicable, worker_restarts, seconds."""
        out = {prefix + k: float(v) for k, v in self._counts.items()}
        out[prefix + "seconds"] = self._seconds
        return out

    def close(self) -> None:
        """Stop worker processes (a later ``score`` starts new ones)."""
        workers, self._workers = self._workers, []
        for w in workers:
            w.stop()

    def __enter__(self) -> BatchScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; daemon workers also die with the parent
        try:
            self.close()
        except Exception:
            pass

    # ----------------------------------------------------------------- threads
    def _score_threaded(self, completions: Sequence[str], answers: Sequence[Mapping[str, Any]],
                        status: np.ndarray, values: list[float | str]) -> None:
        n, i = len(completions), 0
        while i < n:
            run = _ThreadRun(self.verifier, completions, answers, i, status, values)
            threading.Thread(target=run.run, daemon=True, name="sara-verifier").start()
            while True:
                with run.lock:
                    pos, started = run.pos, run.item_start
                if pos >= n or run.done.wait(max(0.0, started + self.timeout_s - time.monotonic())):
                    i = n
                    break
                with run.lock:
                    if run.pos >= n:
                        i = n
                        break
                    if run.pos == pos and run.item_start == started and time.monotonic() - started >= self.timeout_s:
                        run.abandoned = True  # the stuck call keeps running in the background; its result is ignored
                        status[pos], values[pos] = TIMEOUT, 0.0
                        i = pos + 1
                        break

    # --------------------------------------------------------------- processes
    def _ensure_workers(self) -> None:
        """Start missing workers in parallel and wait until they have imported the verifier."""
        alive = []
        for w in self._workers:
            if w.proc.is_alive():
                alive.append(w)
            else:
                w.kill()
        workers = alive + [_Worker(self._ctx, self.verifier) for _ in range(self.num_workers - len(alive))]
        for w in workers:  # new ones, and replacements still booting from the previous batch
            if not w.wait_ready(_BOOT_TIMEOUT_S):
                for x in workers:
                    x.kill()
                self._workers = []
                raise RuntimeError(_BOOT_ERROR)
        self._workers = workers

    def _score_processes(self, completions: Sequence[str], answers: Sequence[Mapping[str, Any]],
                         status: np.ndarray, values: list[float | str]) -> None:
        self._ensure_workers()
        workers = self._workers
        pending = deque(range(len(completions)))
        remaining = len(completions)

        def feed(w: _Worker) -> None:
            nonlocal remaining
            while pending:
                j = pending.popleft()
                try:
                    w.submit(j, completions[j], answers[j])
                    return
                except Exception as exc:  # e.g. unpicklable answer fields
                    w.item = None
                    status[j], values[j] = ERROR, f"could not send to the verifier worker: {exc}"
                    remaining -= 1

        for w in workers:
            feed(w)
        while remaining:
            busy = [w for w in workers if w.item is not None]
            booting = [w for w in workers if not w.ready]
            if not busy and not booting:
                break
            deadline = min([w.started + self.timeout_s for w in busy] + [w.born + _BOOT_TIMEOUT_S for w in booting])
            ready = wait_connections([w.conn for w in busy + booting], timeout=max(0.0, deadline - time.monotonic()))
            now = time.monotonic()
            for k, w in enumerate(workers):
                if not w.ready:  # a replacement booting in the background while the others keep scoring
                    if w.conn in ready:
                        if not w.wait_ready(0.0):
                            raise RuntimeError(_BOOT_ERROR)
                        feed(w)
                    elif now - w.born >= _BOOT_TIMEOUT_S:
                        raise RuntimeError(_BOOT_ERROR)
                    continue
                if w.item is None:
                    continue
                if w.conn in ready:
                    try:
                        idx, st, v = w.conn.recv()
                        status[idx], values[idx] = st, v
                        replace = False
                    except (EOFError, OSError):  # the worker died (e.g. killed by the OS for memory)
                        status[w.item], values[w.item] = ERROR, "verifier worker died"
                        replace = True
                elif now - w.started >= self.timeout_s:
                    status[w.item], values[w.item] = TIMEOUT, 0.0
                    replace = True
                else:
                    continue
                remaining -= 1
                w.item = None
                if replace:
                    w.kill()
                    workers[k] = _Worker(self._ctx, self.verifier)  # not fed until it says "ready"
                    self._counts["worker_restarts"] += 1
                else:
                    feed(w)


def score_batch(verifier: Callable[..., Any], completions: Sequence[str], answers: Sequence[Mapping[str, Any]], *,
                mode: Mode = "thread", timeout_s: float = 1.0, workers: int | None = None) -> ScoreResult:
    """One-shot ``BatchScorer(...).score(...)`` (worker processes are started and stopped inside the call)."""
    with BatchScorer(verifier, mode=mode, timeout_s=timeout_s, workers=workers) as scorer:
        return scorer.score(completions, answers)
