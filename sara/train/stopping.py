"""The stop watchdog: SIGINT / SIGTERM are answered on time even while the main thread is inside one long native call.

A Python signal handler runs only when the main thread is back in the interpreter, so a countdown started by one
waits for a matrix product, a generation call or a C extension to return. ``StopWatchdog`` does not: while it runs,
the signal module's wakeup file descriptor (``signal.set_wakeup_fd``) is one end of a pipe, to which the C-level
handler writes each signal's number the moment the signal arrives, in whichever thread; a daemon thread reads the
other end. On the first SIGINT / SIGTERM it says on stderr that the run stops after the running step and starts the
grace countdown. When the countdown ends and the block is still running:

* if the Python handler has run (the main thread reached the interpreter and put the earlier handlers back), the
  signal is delivered again and gets what a second one would (SIGTERM's default action ends the process at once,
  SIGINT raises ``KeyboardInterrupt``), and ``margin_s`` later the process exits if it still has not;
* else (the main thread has been inside native code since the signal) the process exits at once.

A second signal while counting ends the process at once when the main thread has not seen the first (else it gets the
earlier handler, and ``margin_s`` to end). Exiting is ``os._exit(128 + signal)`` after
one line on stderr: no step is finished, nothing more is written, and the checkpoint before stays the one
``--resume`` continues from (a checkpoint counts only with its completion marker, written last).
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["EXIT_MARGIN_S", "StopWatchdog", "say"]

EXIT_MARGIN_S = 2.0
"""Seconds a process whose stop signal was delivered again (or that got a second one) has to end by itself, unwinding
its ``finally`` blocks, before the watchdog ends it."""

_SIGNALS = (int(signal.SIGINT), int(signal.SIGTERM))
_STOP = 0  # the byte that ends the watchdog's thread (no signal has number 0)
_ACTIVE: list[StopWatchdog] = []


def say(text: str) -> None:
    """Write a line to stderr's file descriptor (no ``sys.stderr``: safe in a signal handler and any thread)."""
    try:
        os.write(2, f"{text}\n".encode())
    except OSError:  # pragma: no cover - stderr closed
        pass


def _forget_in_child() -> None:
    """After ``fork``: the child has no watchdog thread, so it must not write its signals into the parent's pipe."""
    if _ACTIVE:
        _ACTIVE.clear()
        try:
            signal.set_wakeup_fd(-1)
        except ValueError:  # forked from a thread other than the main one: Python resets nothing there
            pass


os.register_at_fork(after_in_child=_forget_in_child)


class StopWatchdog:
    """A thread that enforces the stop grace period from the moment a SIGINT / SIGTERM arrives (module docstring).

    Start it in the main thread after installing a Python handler for both signals (the C-level handler writes the
    wakeup byte only for signals that have one); stop it when the guarded block ends.

    Args:
        grace_s: Seconds from the first signal to the end of the block.
        redeliver: Called with the signal number when the countdown ends after the Python handler ran; delivers the
            signal again.
        margin_s: Seconds a redelivered (or second) signal has to end the process before the watchdog does.

    Attributes:
        handled: Set by the Python signal handler: the main thread has seen the signal.
    """

    def __init__(self, grace_s: float, redeliver: Callable[[int], None], margin_s: float = EXIT_MARGIN_S) -> None:
        self.grace_s, self.margin_s, self.redeliver = float(grace_s), float(margin_s), redeliver
        self.handled = False
        self._lock = threading.Lock()
        self._stopped = False
        self._fds: tuple[int, int] | None = None
        self._previous_fd = -1
        self._thread: threading.Thread | None = None

    def start(self) -> StopWatchdog:
        """Take the wakeup descriptor and start the thread (main thread only)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._fds = (r, w)
        self._previous_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        _ACTIVE.append(self)
        self._thread = threading.Thread(target=self._run, args=(r,), daemon=True, name="sara-stop-watchdog")
        self._thread.start()
        return self

    def stop(self) -> None:
        """Give the wakeup descriptor back, end the thread, close the pipe; the watchdog exits nothing after this."""
        with self._lock:
            self._stopped = True
        if self._fds is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        r, w = self._fds
        try:
            os.write(w, bytes([_STOP]))
        except OSError:  # pragma: no cover - the pipe is full of signal bytes: the thread is reading it anyway
            pass
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        os.close(r)
        os.close(w)
        self._fds = None

    def _exit(self, signum: int, line: str | None) -> None:
        with self._lock:
            if self._stopped:
                return
            if line:
                say(line)
            os._exit(128 + signum)

    def _run(self, r: int) -> None:
        first: int | None = None
        deadline: float | None = None
        last_stage = False  # the signal was delivered again, or a second one came: the margin runs
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([r], [], [], wait)
            if not ready and first is not None:  # a deadline passed
                name = signal.Signals(first).name
                if last_stage:
                    self._exit(first, f"sara: {name}: the process has not ended {self.margin_s:g} s after the "
                                      f"signal's second delivery; exiting now (status {128 + first})")
                    return
                over = (f"sara: {name}: still running {self.grace_s:g} s after it; stopping now, without finishing "
                        "or checkpointing the running step (SARA_STOP_GRACE_S sets the wait)")
                if not self.handled:  # the main thread has not reached the interpreter since the signal came
                    self._exit(first, over)
                    return
                with self._lock:
                    if self._stopped:
                        return
                    say(over)
                self.redeliver(first)
                last_stage, deadline = True, time.monotonic() + self.margin_s
                continue
            for b in os.read(r, 512):
                if b == _STOP:
                    return
                if b not in _SIGNALS:
                    continue
                if first is None:
                    first, deadline = b, time.monotonic() + self.grace_s
                    say(f"sara: {signal.Signals(b).name}: stopping after the running step (within {self.grace_s:g} "
                        "s; a second signal stops at once)")
                elif not last_stage:  # a second signal (our own redelivery comes in the last stage)
                    if not self.handled:  # nothing but this thread can answer it
                        self._exit(b, f"sara: {signal.Signals(b).name} again: stopping now (status {128 + b})")
                        return
                    last_stage, deadline = True, min(deadline or 0.0, time.monotonic() + self.margin_s)
