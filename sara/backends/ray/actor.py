"""The body of a Ray worker: ``build_object`` makes its backend / env, ``Worker`` holds it with its weight version.

Runs inside the actor process; it never imports Ray itself (the pool wraps ``Worker`` with ``ray.remote``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from sara.backends.ray.config import Factory
from sara.config import ConfigError

__all__ = ["StaleWeightsError", "WorkerFailedError", "Worker", "build_object"]


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


class Worker:
    """Ray actor body: owns one backend / env and the weight version it holds."""

    def __init__(self, factory: Factory, index: int) -> None:
        self.index = index
        self.version = 0
        self.obj = build_object(factory)

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "version": self.version, "pid": os.getpid(), "type": type(self.obj).__name__}

    def load_weights(self, state: Mapping[str, Any], version: int) -> int:
        if version < self.version:
            raise StaleWeightsError(f"worker {self.index}: asked to load weights version {version} while holding "
                                    f"the newer version {self.version}")
        if version > self.version:
            fn = getattr(self.obj, "update_weights", None)
            if fn is None:
                raise TypeError(f"worker {self.index}: {type(self.obj).__name__} has no update_weights method")
            fn(state, version)
            self.version = version
        return self.version

    def call(self, method: str, version: int, *args: Any) -> Any:
        if version != self.version:
            raise StaleWeightsError(f"worker {self.index}: round asked for weights version {version} but the worker "
                                    f"holds version {self.version}")
        return getattr(self.obj, method)(*args)

    def attribute(self, name: str) -> Any:
        return getattr(self.obj, name)

    def has(self, names: Sequence[str]) -> list[bool]:
        return [hasattr(self.obj, n) for n in names]

    def close(self) -> None:
        fn = getattr(self.obj, "close", None)
        if fn is not None:
            fn()
