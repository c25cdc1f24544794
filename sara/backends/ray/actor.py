"""The body of a Ray worker: ``build_object`` makes its backend / env, ``Worker`` holds it with its weight version
and streams through it (the object's own ``submit`` / ``poll`` / ``abort``, or ``MicroBatchStream`` over its batch call).

Runs inside the actor process; it never imports Ray itself (the pool wraps ``Worker`` with ``ray.remote``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from sara.backends.ray.config import Factory
from sara.config import ConfigError
from sara.envs.base import Closeable, Completion, SeedAware, StreamingBackend, StreamingEnv, UpdatesWeights

__all__ = ["StaleWeightsError", "WorkerFailedError", "Worker", "build_object", "MicroBatchStream", "streams_natively"]



class StaleWeightsError(RuntimeError):
    """An actor was asked to generate with a weight version it does not hold."""


class WorkerFailedError(RuntimeError):
    """A worker kept failing (more than ``max_restarts`` times in a row); the message names it and its task."""


def build_object(factory: Factory) -> Any:
    """Build a worker's backend / env from a factory callable or a backend spec string (runs in the actor).

    A spec ``"name:key=value,..."`` calls ``sara.backends.BACKENDS[name](None, {key: value, ...})`` (a backend that
    loads its own model, e.g. ``"hf:model=smollm2"``).
    """
    if isinstance(factory, str):
        from sara.backends import BACKENDS

        try:
            make, options = BACKENDS.from_spec(factory)
        except ConfigError as exc:
            raise ConfigError(f"ray pool: field 'backend': {exc}") from None
        return make(None, options)
    if not callable(factory):
        raise ConfigError(f"ray pool: field 'factory': expected a callable or a backend spec string, got {factory!r}")
    return factory()


def streams_natively(obj: Any) -> bool:
    """Whether ``obj`` is a ``StreamingBackend`` or a ``StreamingEnv`` (a ``TaskEnv`` on a batch-only backend is not:
    it has no ``slots``)."""
    return isinstance(obj, (StreamingBackend, StreamingEnv))


class MicroBatchStream:
    """Streaming over a backend / env that only has a batch call (``generate(requests, sampling)`` or
    ``rollout(requests)``): ``submit`` queues single requests, ``poll`` runs ONE batch call on the oldest ``slots``
    queued requests that share the first one's extra arguments (sampling) and returns all of them.

    Nothing generates between polls, so ``abort`` only drops queued requests and returns 0 tokens. Completions are the
    ones the batch call gives (per-seed backends: the same as in any other batch).

    Args:
        obj: The backend (``generate``) or environment (``rollout``).
        slots: Requests per batch call.
    """

    def __init__(self, obj: Any, slots: int) -> None:
        self.obj = obj
        self.slots = int(slots)
        self._queue: dict[int, tuple[Any, tuple[Any, ...]]] = {}  # tag -> (request, extra args), oldest first

    def submit(self, items: Sequence[tuple[int, Any]], *extra: Any) -> None:
        for tag, request in items:
            self._queue[int(tag)] = (request, tuple(extra))

    def poll(self, timeout: float | None = None) -> list[tuple[int, Any]]:
        if not self._queue:
            return []
        first = next(iter(self._queue.values()))[1]
        tags = [t for t, (_, extra) in self._queue.items() if extra == first][: self.slots]
        requests = [self._queue.pop(t)[0] for t in tags]
        method = self.obj.generate if first else self.obj.rollout  # generate(requests, sampling) / rollout(requests)
        out = method(requests, *first)
        return [(t, row[0]) for t, row in zip(tags, out, strict=True)]

    def abort(self, tags: Sequence[int]) -> int:
        for t in tags:
            self._queue.pop(int(t), None)
        return 0

    def inflight(self) -> int:
        return len(self._queue)


class Worker:
    """Ray actor body: owns one backend / env and the weight version it holds.

    Args:
        factory: Builds the backend / env (``build_object``).
        index: The worker's index in its pool.
        micro_batch: Requests per batch call when the object does not stream itself (``MicroBatchStream``).
    """

    def __init__(self, factory: Factory, index: int, micro_batch: int = 16) -> None:
        self.index = index
        self.version = 0
        self.obj = build_object(factory)
        self.native_stream = streams_natively(self.obj)
        self.stream: Any = self.obj if self.native_stream else MicroBatchStream(self.obj, micro_batch)

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "version": self.version, "pid": os.getpid(), "type": type(self.obj).__name__,
                "slots": int(self.stream.slots), "native_stream": self.native_stream}

    def load_weights(self, state: Mapping[str, Any], version: int) -> int:
        if version < self.version:
            raise StaleWeightsError(f"worker {self.index}: asked to load weights version {version} while holding "
                                    f"the newer version {self.version}")
        if version > self.version:
            if not isinstance(self.obj, UpdatesWeights):
                raise TypeError(f"worker {self.index}: {type(self.obj).__name__} has no update_weights method")
            self.obj.update_weights(state, version)
            self.version = version
        return self.version

    def call(self, method: str, version: int, *args: Any) -> Any:
        if version != self.version:
            raise StaleWeightsError(f"worker {self.index}: round asked for weights version {version} but the worker "
                                    f"holds version {self.version}")
        return getattr(self.obj, method)(*args)

    def stream_submit(self, version: int, items: Sequence[tuple[int, Any]], *extra: Any) -> None:
        """Queue single requests under tags (``extra``: the sampling config of a backend, nothing for an env)."""
        if version != self.version:
            raise StaleWeightsError(f"worker {self.index}: submit asked for weights version {version} but the worker "
                                    f"holds version {self.version}")
        self.stream.submit(items, *extra)

    def stream_poll(self, timeout: float | None) -> list[tuple[int, Any]]:
        """Every finished ``(tag, completion)``; a completion without a ``policy_version`` gets the version this
        worker holds when it comes back."""
        out = self.stream.poll(timeout)
        stamped = []
        for tag, c in out:
            if isinstance(c, Completion) and c.policy_version is None:
                c = dataclasses.replace(c, policy_version=self.version)
            stamped.append((int(tag), c))
        return stamped

    def stream_abort(self, tags: Sequence[int]) -> int:
        return int(self.stream.abort(tags))

    def seeds_per_request(self) -> bool:
        """Whether the object honours per-request seeds (a ``SeedAware`` one that says so)."""
        return isinstance(self.obj, SeedAware) and bool(self.obj.per_request_seeds)

    def prompts(self) -> Any:
        """The environment's prompt pool (``RolloutEnv.prompts``)."""
        return self.obj.prompts

    def attribute(self, name: str) -> Any:
        """Any attribute of the object, by name (inspection in tests and benchmarks)."""
        return getattr(self.obj, name)

    def has(self, names: Sequence[str]) -> list[bool]:
        """Whether the object has each of the methods ``names`` (the env pool's forwarded analysis helpers)."""
        return [hasattr(self.obj, n) for n in names]

    def close(self) -> None:
        if isinstance(self.obj, Closeable):
            self.obj.close()
