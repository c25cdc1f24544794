"""Verifier worker processes (``BatchScorer(mode="process")``): bounded in time and memory, deaf to Ctrl-C.

Each worker is a process that imports the verifier once and then scores ``(index, completion, answer)`` messages in
its main thread (so a verifier's ``signal.alarm`` timeouts work there). What bounds a call:

- time: the parent kills a worker whose call runs past ``timeout_s`` (the item is a ``TIMEOUT``) and starts a
  replacement;
- memory: a worker may grow at most ``memory_mb`` MiB past what it holds once the verifier is imported
  (``RLIMIT_AS``): a call that wants more gets a ``MemoryError`` (the item is an ``ERROR``);
- signals: workers start with SIGINT blocked and then ignore it, so a Ctrl-C reaches only the parent (the trainer
  finishes the step) instead of killing the workers mid-call; a worker that dies anyway (SIGTERM to the process
  group, the OOM killer) has its item scored again by a fresh worker, once: an interrupted verification is not a
  wrong answer. A second death on the same item makes it an ``ERROR``.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from typing import Any

__all__ = ["WorkerPool"]

BOOT_TIMEOUT_S = 120.0
BOOT_ERROR = ("BatchScorer: a verifier worker did not start (is the verifier picklable, and is the script guarded by "
              "if __name__ == '__main__'?)")
OK, NOT_APPLICABLE, ERROR, TIMEOUT = 0, 1, 2, 3


def _limit_memory(memory_mb: int | None) -> None:
    """Cap this process's address space at its current size plus ``memory_mb`` MiB (Linux; elsewhere nothing)."""
    if memory_mb is None:
        return
    try:
        import resource

        with open("/proc/self/statm", encoding="ascii") as fh:
            current = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = current + int(memory_mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, OSError, ValueError):  # pragma: no cover - no /proc or no RLIMIT_AS
        pass


def _worker_main(conn: Connection, verifier: Callable[..., Any], call: Callable[..., tuple[int, Any]],
                 memory_mb: int | None) -> None:
    """Worker process loop: ``(index, completion, answer)`` in, ``(index, status, value)`` out; ``None`` stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _limit_memory(memory_mb)
    conn.send("ready")  # the verifier is unpickled (its module imported): item timing can start
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, completion, answer = msg
        conn.send((idx, *call(verifier, completion, answer)))


class _Worker:
    def __init__(self, ctx: Any, verifier: Callable[..., Any], call: Callable[..., Any], memory_mb: int | None) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child, verifier, call, memory_mb), daemon=True,
                                name="sara-verifier")
        blocked = hasattr(signal, "pthread_sigmask")
        if blocked:  # the child inherits the mask: a Ctrl-C while it boots cannot kill it
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.proc.start()
        finally:
            if blocked:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
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


class WorkerPool:
    """Persistent verifier worker processes (see the module docstring).

    Args:
        ctx: A ``multiprocessing`` context (its start method).
        verifier: The (picklable) verifier.
        call: ``call(verifier, completion, answer) -> (status, value)``, run in the worker (picklable).
        workers: Worker processes.
        memory_mb: Memory a worker may add once started, in MiB (None = unbounded).
    """

    def __init__(self, ctx: Any, verifier: Callable[..., Any], call: Callable[..., Any], workers: int,
                 memory_mb: int | None) -> None:
        self.ctx, self.verifier, self.call, self.size, self.memory_mb = ctx, verifier, call, workers, memory_mb
        self.workers: list[_Worker] = []
        self.restarts = 0

    def _new(self) -> _Worker:
        return _Worker(self.ctx, self.verifier, self.call, self.memory_mb)

    def close(self) -> None:
        """Stop the workers (a later ``score`` starts new ones)."""
        workers, self.workers = self.workers, []
        for w in workers:
            w.stop()

    def _ensure(self) -> None:
        """Start missing workers in parallel and wait until they have imported the verifier."""
        alive = []
        for w in self.workers:
            if w.proc.is_alive():
                alive.append(w)
            else:
                w.kill()
        workers = alive + [self._new() for _ in range(self.size - len(alive))]
        for w in workers:  # new ones, and replacements still booting from the previous batch
            if not w.wait_ready(BOOT_TIMEOUT_S):
                for x in workers:
                    x.kill()
                self.workers = []
                raise RuntimeError(BOOT_ERROR)
        self.workers = workers

    def score(self, completions: Sequence[str], answers: Sequence[Mapping[str, Any]], status: Any,
              values: list[Any], timeout_s: float) -> None:
        """Score every item into ``status`` / ``values`` (per-item status codes as in ``sara.envs.tasks.scoring``)."""
        self._ensure()
        workers = self.workers
        pending = deque(range(len(completions)))
        remaining = len(completions)
        retried: set[int] = set()

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

        while remaining:
            for w in workers:  # idle workers take what is waiting (at the start, and items scored again)
                if pending and w.ready and w.item is None:
                    feed(w)
            busy = [w for w in workers if w.item is not None]
            booting = [w for w in workers if not w.ready]
            if not busy and not booting:
                break
            deadline = min([w.started + timeout_s for w in busy] + [w.born + BOOT_TIMEOUT_S for w in booting])
            ready = wait_connections([w.conn for w in busy + booting], timeout=max(0.0, deadline - time.monotonic()))
            now = time.monotonic()
            for k, w in enumerate(workers):
                if not w.ready:  # a replacement booting in the background while the others keep scoring
                    if w.conn in ready:
                        if not w.wait_ready(0.0):
                            raise RuntimeError(BOOT_ERROR)
                        feed(w)
                    elif now - w.born >= BOOT_TIMEOUT_S:
                        raise RuntimeError(BOOT_ERROR)
                    continue
                if w.item is None:
                    continue
                item = w.item
                if w.conn in ready:
                    try:
                        idx, st, v = w.conn.recv()
                        status[idx], values[idx] = st, v
                        replace = False
                    except (EOFError, OSError):  # the worker died: killed by a signal or the OS, or it exited
                        replace = True
                        if item not in retried:  # interrupted, not wrong: score it again in a fresh worker
                            retried.add(item)
                            pending.appendleft(item)
                            w.item = None
                            w.kill()
                            workers[k] = self._new()
                            self.restarts += 1
                            continue
                        code = w.proc.exitcode
                        status[item], values[item] = ERROR, f"verifier worker died twice on this item (exit {code})"
                elif now - w.started >= timeout_s:
                    status[item], values[item] = TIMEOUT, 0.0
                    replace = True
                else:
                    continue
                remaining -= 1
                w.item = None
                if replace:
                    w.kill()
                    workers[k] = self._new()  # not fed until it says "ready"
                    self.restarts += 1
                else:
                    feed(w)
