"""A time limit for pure-Python work on any thread, where ``signal.alarm`` (main thread only) cannot reach.

``call_with_time_limit(fn, seconds)`` runs ``fn()`` in a fresh helper thread and waits for it. Past ``seconds`` the
caller raises ``TimeLimitExceeded`` inside the helper (``PyThreadState_SetAsyncExc``), again every ``RETRY_S``
seconds for up to ``GRACE_S`` seconds, until the helper gives up; the caller then returns ``(False, None)`` whether
the helper has stopped or not. The exception is delivered between Python bytecodes, as a signal handler's is: a
single long C call (a huge integer power, say) is not interrupted, so callers bound those before they run
(``sara.envs.tasks.mathguard``). ``TimeLimitExceeded`` derives from ``BaseException``, so library code that catches
``Exception`` does not swallow it.

Only the helper thread ever receives the exception, and only while it has not finished (it marks itself finished
under the lock the caller holds while it raises), so the exception never reaches the caller, a later call, or a
thread that has ended; and the helper receives every exception raised in it before it ends (see ``_Call``).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["GRACE_S", "TimeLimitExceeded", "call_with_time_limit"]

T = TypeVar("T")
GRACE_S = 1.0
"""How long the caller keeps interrupting a helper past its time limit before it returns without it."""
RETRY_S = 0.05
"""Interval between two interruptions of a helper that caught one and went on."""

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
_set_async_exc.restype = ctypes.c_int
_DRAIN = 100
"""Rounds the helper waits, once finished, for an interruption the caller raised that it has not received yet."""


class TimeLimitExceeded(BaseException):
    """Raised inside a helper thread whose call ran past its time limit."""

    seq = 0
    """Which interruption of the call this is (1, 2, ...)."""


@functools.lru_cache(maxsize=64)
def _interruption(seq: int) -> type[TimeLimitExceeded]:
    """The exception class of the call's ``seq``-th interruption (a class: that is what a thread can be sent)."""
    return type("TimeLimitExceeded", (TimeLimitExceeded,), {"seq": seq, "__module__": __name__})


class _Call:
    """One time-limited call: the helper's state, shared with the caller under ``lock``.

    Every interruption the caller raises must be received by the helper: one that no thread receives leaves the
    interpreter's pending-call flag set (every thread then checks it at each bytecode check, and a profiled or
    traced thread stalls on it). So the caller counts what it raises (``fired``), the helper records the latest it
    received (``received``), and the helper, once finished (after which nothing more is raised), waits for an
    outstanding one before it ends.
    """

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.finished = False
        self.outcome: tuple[str, Any] = ("timeout", None)
        self.fired = 0
        self.received = 0

    def run(self) -> None:
        """Helper thread: run ``fn`` and record ``("ok", value)``, ``("error", exc)`` or ``("timeout", None)``."""
        outcome: tuple[str, Any] = ("timeout", None)
        try:
            try:
                outcome = ("ok", self.fn())
            except TimeLimitExceeded as exc:
                self.received = exc.seq
            except BaseException as exc:  # handed to the caller, which re-raises it
                outcome = ("error", exc)
        except TimeLimitExceeded as exc:  # received while handling what fn raised
            self.received = exc.seq
        for _ in range(_DRAIN):
            try:
                with self.lock:
                    if not self.finished:
                        self.finished, self.outcome = True, outcome
                    outstanding = self.received < self.fired
                if not outstanding:
                    break
                for _ in range(1000):  # an interruption is received at a backward jump
                    pass
            except TimeLimitExceeded as exc:
                self.received = exc.seq
        self.done.set()

    def interrupt(self, thread: threading.Thread) -> None:
        """Raise ``TimeLimitExceeded`` in the helper unless it has finished."""
        with self.lock:
            if not self.finished and thread.is_alive() and thread.ident is not None:
                self.fired += 1
                _set_async_exc(thread.ident, ctypes.py_object(_interruption(self.fired)))


def call_with_time_limit(fn: Callable[[], T], seconds: float) -> tuple[bool, T | None]:
    """Run ``fn()`` for at most ``seconds`` (plus up to ``GRACE_S`` while it is interrupted).

    Args:
        fn: The work; it must not hold locks that other threads need (an interruption may land anywhere in it).
        seconds: Time limit, > 0.

    Returns:
        ``(True, fn())`` when it finished in time, ``(False, None)`` when it was stopped or abandoned.

    Raises:
        BaseException: What ``fn`` raised (other than ``TimeLimitExceeded``).
    """
    call = _Call(fn)
    thread = threading.Thread(target=call.run, daemon=True, name="sara-time-limited")
    thread.start()
    try:
        if not call.done.wait(seconds):
            for _ in range(max(1, round(GRACE_S / RETRY_S))):
                call.interrupt(thread)
                if call.done.wait(RETRY_S):
                    break
    finally:
        if not call.done.is_set():  # the caller is leaving (a KeyboardInterrupt, or the grace is over)
            call.interrupt(thread)
    with call.lock:
        kind, value = call.outcome
    if kind == "error":
        raise value
    return (True, value) if kind == "ok" else (False, None)
