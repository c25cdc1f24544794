"""One small generic registry: objects by name, ``"module:attr"`` entry points, duplicate checks.

Example:
    >>> ALLOCATORS = Registry("allocator")
    >>> @ALLOCATORS.register("uniform")
    ... class Uniform: ...
    >>> ALLOCATORS.get("uniform") is Uniform
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "load_entry_point"]


def load_entry_point(spec: str) -> object:
    """Import ``"package.module:attr"`` (``attr`` may be dotted) and return the object."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"entry point {spec!r} must look like 'package.module:attr'")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """A name -> object mapping with duplicate checks and lazy ``"module:attr"`` entries.

    Args:
        kind: What is registered (used in error messages), e.g. ``"allocator"``.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T | str] = {}

    def register(self, name: str, obj: T | str | None = None, *, override: bool = False) -> Callable[[T], T] | T | str:
        """Register ``obj`` under ``name``; without ``obj``, return a decorator.

        ``obj`` may be a ``"module:attr"`` string, imported on first ``get``.

        Raises:
            ValueError: ``name`` is already registered and ``override`` is false.
        """
        if obj is None:

            def deco(o: T) -> T:
                self.register(name, o, override=override)
                return o

            return deco
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._items and not override and self._items[name] is not obj:
            raise ValueError(f"{self.kind} {name!r} is already registered; pass override=True to replace it")
        self._items[name] = obj
        return obj

    def get(self, name: str) -> T:
        """Look up ``name``; a ``"module:attr"`` name not registered is imported directly."""
        if name in self._items:
            obj = self._items[name]
            if isinstance(obj, str):
                obj = load_entry_point(obj)  # type: ignore[assignment]
                self._items[name] = obj
            return obj  # type: ignore[return-value]
        if ":" in name:
            try:
                return load_entry_point(name)  # type: ignore[return-value]
            except (ImportError, AttributeError, ValueError) as exc:
                raise KeyError(f"unknown {self.kind} {name!r} ({exc}); known: {', '.join(self.names())}") from exc
        raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")

    def from_spec(self, spec: str) -> tuple[T, dict[str, str]]:
        """Parse ``"name:key=value,..."`` and look the name up; ``(object, options)``.

        Raises:
            ConfigError: unknown name (the message lists the known ones) or a malformed spec.
        """
        from sara.config import ConfigError, parse_spec

        name, options = parse_spec(spec)
        try:
            return self.get(name), options
        except KeyError as exc:
            raise ConfigError(str(exc.args[0])) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._items)
