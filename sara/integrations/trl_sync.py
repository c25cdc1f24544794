"""The weights gate of ``SaraRolloutWorker`` and the ``WeightTransferProtocol`` that goes through it.

The worker's thread generates under the gate; TRL's weight sync (``BackendWeightTransfer.pause`` ... ``resume``) and
``SaraRolloutWorker.evaluate`` hold it to use the backend's weights alone. A holder that asks for the gate while the
worker generates does not wait for the engine call in flight:

- on a backend that generates in decode steps (``sara.envs.base.SteppedEngine``: the HF backend's rounds and its
  streaming loop), the worker hands the gate over at the engine's next step boundary (``WeightsGate.between_steps``,
  installed as the backend's ``between_steps``) and takes it back when the holder releases it; the rows in flight keep
  their tokens and KV and go on with the new weights (TRL's own vLLM path pauses the same way, vLLM's
  ``pause(mode="keep")``); a row's ``policy_version`` stays the version of its first token, so a sample's
  ``model_version`` is never newer than any of its tokens;
- on any other backend, at the end of the engine call in flight;
- either way the worker starts no engine call while a holder is waiting (Python's lock is not fair: a thread that
  releases and re-acquires it in a loop could otherwise keep a waiting sync out for many calls).

No completion is dropped or restarted by a sync, so the driver's accounting (committed / abandoned / discarded /
aborted) is what it would be without one. A completion is the same function of its prompt, its seed and the weights
each of its tokens was drawn under.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["WeightsGate", "BackendWeightTransfer"]


class WeightsGate:
    """Exclusive use of a backend's weights between one generating thread and the holders that cut in.

    Args:
        stopping: Called by the generating thread while it waits for the gate: a true result makes ``generating``
            and ``between_steps`` raise ``interrupt``.
        interrupt: The exception type raised then.

    Attributes:
        handovers: Times the generating thread handed the gate over in the middle of an engine call.
    """

    def __init__(self, stopping: Callable[[], bool], interrupt: type[BaseException]) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition()
        self._wanted = 0  # holders asking for the gate and not yet holding it
        self._stopping, self._interrupt = stopping, interrupt
        self.generator: threading.Thread | None = None  # the thread that hands the gate over between steps
        self._owned = False  # the generating thread holds the lock (read and written by that thread only)
        self.handovers = 0

    @property
    def waiting(self) -> int:
        """Holders that asked for the gate and do not hold it yet."""
        return self._wanted

    # ------------------------------------------------------------------------------------------------ holders
    def hold(self) -> None:
        """Take the gate for a sync or an evaluation: the generating thread hands it over at its next step boundary
        (or the end of its engine call), and starts nothing new until ``release``."""
        with self._cond:
            self._wanted += 1
        try:
            self._lock.acquire()
        finally:
            with self._cond:
                self._wanted -= 1
                self._cond.notify_all()

    def release(self) -> None:
        """Give the gate back to the generating thread."""
        self._lock.release()

    # ------------------------------------------------------------------------------------------------ the generator
    @contextmanager
    def generating(self) -> Iterator[None]:
        """Hold the gate for one engine call of the generating thread, taken after every waiting holder had its turn.

        Raises:
            interrupt: ``stopping()`` became true while waiting for the gate (here or at a step boundary).
        """
        self._take()
        self._owned = True
        try:
            yield
        finally:
            if self._owned:  # False when a step boundary handed the gate over and was interrupted
                self._owned = False
                self._lock.release()

    def between_steps(self) -> None:
        """The backend's step boundary (``SteppedEngine.between_steps``): in the generating thread, hand the gate to
        a holder waiting for it and take it back once released; a no-op in any other thread (an evaluation's own
        generation) or when no holder waits."""
        if threading.current_thread() is not self.generator or not self._wanted or not self._owned:
            return
        self.handovers += 1
        self._owned = False
        self._lock.release()
        self._take()
        self._owned = True

    def _take(self) -> None:
        while True:
            with self._cond:
                while self._wanted:
                    self._check_stop()
                    self._cond.wait(0.1)
            if self._lock.acquire(timeout=0.1):
                return
            self._check_stop()

    def _check_stop(self) -> None:
        if self._stopping():
            raise self._interrupt


class BackendWeightTransfer:
    """TRL ``WeightTransferProtocol`` into a ``SaraRolloutWorker``'s backend (``backend.update_weights``).

    The version loaded is the one the trainer announces right after the transfer (its ``model_version + 1``); the
    worker's ``update_model_version`` checks it.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._held = False

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        """Hold the worker's generation: it stops at its engine's next decode step (see the module docstring)."""
        if not self._held:
            self.worker.gate.hold()
            self._held = True

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        w = self.worker
        state = {name: t.detach() for name, t in iterator}  # the backend copies (and casts) them
        w.backend.update_weights(state, max(w.backend_version, w.model_version) + 1)

    def resume(self) -> None:
        if self._held:
            self._held = False
            self.worker.gate.release()

    def destroy(self) -> None:
        self.resume()
