"""Batch scoring of untrusted completions with a per-call time limit (and, in worker processes, a memory limit).

``BatchScorer(verifier, mode=..., timeout_s=...)`` scores many ``(completion, answer_fields)`` pairs. Whatever a
verifier does, scoring never raises: a call that raises, returns something that is not a finite number (or ``None``),
or runs past ``timeout_s`` gets reward 0 and is counted (``ScoreResult.status`` per item, ``metrics()`` in total).

Modes:
    ``"thread"``: calls run one after another in a helper thread that the caller watches; the scorer keeps its
        helper threads and reuses them from batch to batch (a thread is started only for a scorer's first batch, for
        a concurrent ``score`` call, and after a timeout). A call past its limit is abandoned (Python cannot kill a
        thread: it keeps running in the background until it returns, and a call that holds the GIL in C code, a huge
        integer power say, stalls the whole process) and the rest of the batch continues in another helper thread;
        while ``MAX_STUCK_THREADS`` abandoned calls are still running, the rest of a batch times out at once instead.
        If the system refuses a new thread for a moment (``RuntimeError: can't start new thread``), the scorer
        retries briefly, then scores the rest of the batch in the caller's thread. Only for verifiers that bound
        their own work in time and memory, as the built-in thread-safe ones do (``verifier_thread_safe``).
    ``"process"``: calls run in persistent worker processes (``workers`` of them, ``sara.envs.tasks.workers``); a
        worker past its time limit is killed and replaced, a worker may use at most ``memory_mb`` MiB more than it
        holds after importing the verifier, and workers ignore Ctrl-C. Needed for verifiers that are not thread-safe
        or may not bound their work: math-verify's own timeouts use ``signal.alarm``, which only works in a main
        thread (each worker's calls run in its main thread). The verifier must be picklable (a module-level function
        or a ``functools.partial`` of one), and scripts need the usual ``if __name__ == "__main__":`` guard of
        ``multiprocessing``'s spawn start method.
    ``"inline"``: plain calls in the caller's thread, exceptions caught, no time limit (tests, and verifiers that
        bound their own work).

A verifier that is not thread-safe (``thread_safe = False`` on the function, e.g. ``sara.envs.tasks.math.verify``)
is refused in the ``thread`` and ``inline`` modes: only worker processes bound it.
"""

from __future__ import annotations

import functools
import math
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from sara.config import ConfigError
from sara.envs.tasks.workers import WorkerPool

__all__ = ["BatchScorer", "ScoreResult", "OK", "NOT_APPLICABLE", "ERROR", "TIMEOUT", "MAX_STUCK_THREADS", "score_batch",
           "scorer_mode", "verifier_thread_safe"]

OK, NOT_APPLICABLE, ERROR, TIMEOUT = 0, 1, 2, 3
"""Per-item status codes of ``ScoreResult.status``."""

Mode = Literal["thread", "process", "inline"]
_MAX_ERRORS_KEPT = 8
MEMORY_MB = 2048
"""Default memory a verifier worker process may add once started, in MiB."""
MAX_STUCK_THREADS = 8
"""Abandoned verifier calls (past their time limit, still running) a ``thread``-mode scorer lets run at once."""
_START_RETRIES_S = (0.0, 0.05, 0.2, 1.0)


def verifier_thread_safe(verifier: Any) -> bool:
    """Whether ``verifier`` may run in a thread: its ``thread_safe`` attribute (through ``functools.partial``),
    True when it has none."""
    while isinstance(verifier, functools.partial):
        verifier = verifier.func
    return bool(getattr(verifier, "thread_safe", True))


def scorer_mode(requested: str, task: Any) -> Mode:
    """The scoring mode of ``task`` for the setting ``requested`` (``auto``: ``thread`` for a thread-safe task, else
    ``process``).

    Raises:
        ConfigError: ``thread`` or ``inline`` for a task whose verifier is not thread-safe (naming the field).
    """
    safe = task.thread_safe and verifier_thread_safe(task.verifier)
    if requested == "auto":
        return "thread" if safe else "process"
    if requested in ("thread", "inline") and not safe:
        raise ConfigError(f"train config: field 'scorer': task {task.id!r} has a verifier that is not thread-safe "
                          f"(it can run unbounded in time and memory outside a worker process), so scorer="
                          f"{requested} cannot bound it; use scorer=auto or scorer=process")
    return requested  # type: ignore[return-value]


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


class _Helper:
    """A helper thread of a ``thread``-mode scorer: runs one ``_ThreadRun`` after another from its queue, and ends
    after a run it was abandoned in (the scorer has moved on) or on ``None``."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, args=(self.jobs,), daemon=True, name="sara-verifier")
        self.thread.start()  # RuntimeError when the system refuses a thread

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:  # holds the queue only, so an unused scorer can be collected
        while (run := jobs.get()) is not None:
            run.run()
            if run.abandoned:
                return

    @classmethod
    def start(cls) -> _Helper:
        """A new helper, retried briefly while the system refuses a thread.

        Raises:
            RuntimeError: the system still refuses a new thread ("can't start new thread").
        """
        for delay in _START_RETRIES_S[:-1]:
            time.sleep(delay)
            try:
                return cls()
            except RuntimeError:  # out of threads or memory for the moment
                continue
        time.sleep(_START_RETRIES_S[-1])
        return cls()


class BatchScorer:
    """Scores batches of completions with one verifier, safely (see the module docstring).

    Args:
        verifier: ``verify(completion, **answer_fields) -> float | None``.
        mode: ``"thread"``, ``"process"`` or ``"inline"``.
        timeout_s: Per-call time limit in seconds (``thread`` and ``process`` modes).
        workers: Worker processes (``process`` mode); default ``min(2, cpu_count)``.
        mp_context: ``multiprocessing`` start method for workers (``"spawn"`` is safe in processes that run threads,
            e.g. torch or Ray; ``"forkserver"`` restarts faster).
        memory_mb: Memory a worker process may add once started, in MiB (``process`` mode; None = unbounded).

    Raises:
        ValueError: an unknown mode, a non-positive time limit, or ``thread`` / ``inline`` for a verifier that is
            not thread-safe.
    """

    def __init__(self, verifier: Callable[..., Any], *, mode: Mode = "thread", timeout_s: float = 1.0,
                 workers: int | None = None, mp_context: str = "spawn", memory_mb: int | None = MEMORY_MB) -> None:
        if mode not in ("thread", "process", "inline"):
            raise ValueError(f"BatchScorer: field 'mode' must be 'thread', 'process' or 'inline', got {mode!r}")
        if not timeout_s > 0 or not math.isfinite(timeout_s):
            raise ValueError(f"BatchScorer: field 'timeout_s' must be > 0 and finite, got {timeout_s!r}")
        if not callable(verifier):
            raise TypeError("BatchScorer: verifier must be callable")
        if mode != "process" and not verifier_thread_safe(verifier):
            raise ValueError(f"BatchScorer: field 'mode': verifier {getattr(verifier, '__qualname__', verifier)!r} is "
                             f"not thread-safe and only worker processes bound it in time and memory; use "
                             f"mode='process' (not {mode!r})")
        self.verifier = verifier
        self.mode: Mode = mode
        self.timeout_s = float(timeout_s)
        self.num_workers = max(1, workers if workers is not None else min(2, os.cpu_count() or 1))
        self._pool = WorkerPool(mp.get_context(mp_context), verifier, _call, self.num_workers, memory_mb) \
            if mode == "process" else None
        self._counts = {"calls": 0, "errors": 0, "timeouts": 0, "not_applicable": 0, "worker_restarts": 0}
        self._seconds = 0.0
        self._helpers_lock = threading.Lock()
        self._idle: list[_Helper] = []  # thread mode: helpers waiting for the next batch
        self._stuck: list[threading.Thread] = []  # thread mode: helpers still running an abandoned call

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
                assert self._pool is not None
                self._pool.score(completions, answers, status, values, self.timeout_s)
                self._counts["worker_restarts"] = self._pool.restarts
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
        """Stop worker processes and idle helper threads (a later ``score`` starts new ones)."""
        if self._pool is not None:
            self._pool.close()
        with self._helpers_lock:
            idle, self._idle = self._idle, []
        for helper in idle:
            helper.jobs.put(None)
        for helper in idle:  # idle helpers end at once; a helper running an abandoned call is not waited for
            if helper.thread is not threading.current_thread():
                helper.thread.join(timeout=1.0)

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
            try:
                helper = self._helper()
            except RuntimeError:  # the system refuses new threads: the verifier bounds its own work
                for j in range(i, n):
                    status[j], values[j] = _call(self.verifier, completions[j], answers[j])
                return
            if helper is None:  # too many abandoned calls still running: the rest times out at once
                status[i:], values[i:] = TIMEOUT, [0.0] * (n - i)
                return
            run = _ThreadRun(self.verifier, completions, answers, i, status, values)
            helper.jobs.put(run)
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
            with self._helpers_lock:
                if run.abandoned:
                    self._stuck.append(helper.thread)  # it ends once the abandoned call returns
                else:
                    self._idle.append(helper)

    def _helper(self) -> _Helper | None:
        """An idle helper, else a new one; None while ``MAX_STUCK_THREADS`` abandoned calls are still running.

        Raises:
            RuntimeError: the system refuses a new thread.
        """
        with self._helpers_lock:
            if self._idle:
                return self._idle.pop()
            self._stuck = [t for t in self._stuck if t.is_alive()]
            if len(self._stuck) >= MAX_STUCK_THREADS:
                return None
        return _Helper.start()


def score_batch(verifier: Callable[..., Any], completions: Sequence[str], answers: Sequence[Mapping[str, Any]], *,
                mode: Mode = "thread", timeout_s: float = 1.0, workers: int | None = None) -> ScoreResult:
    """One-shot ``BatchScorer(...).score(...)`` (worker processes are started and stopped inside the call)."""
    with BatchScorer(verifier, mode=mode, timeout_s=timeout_s, workers=workers) as scorer:
        return scorer.score(completions, answers)
