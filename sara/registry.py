"""One small generic registry: objects by name, ``"module:attr"`` entry points, duplicate checks, kind checks.

A name registered in code (``register``) is trusted to be of the registry's kind. A ``"module:attr"`` name that is
not registered (what a config may give) is imported, and then checked to be of the registry's kind BEFORE anything
is called: a class of the expected base, a function annotated to return the expected type, or an object marked
with ``entry_point(kind)``. Importing the module runs its top-level code (a config is code you chose to run); a
``"module:attr"`` that names anything else (``os:system``) is refused without being called.

Example:
    >>> ALLOCATORS = Registry("allocator")
    >>> @ALLOCATORS.register("uniform")
    ... class Uniform: ...
    >>> ALLOCATORS.get("uniform") is Uniform
    True
"""

from __future__ import annotations

import builtins
import functools
import importlib
import inspect
import re
import reprlib
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

__all__ = ["Registry", "brief", "checked_call", "clip", "entry_point", "instance_of", "load_entry_point", "returns",
           "subclass_of", "takes"]

_MARK = "__sara_entry_point__"
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")
Accepts = Callable[[object], bool]


def clip(text: str, limit: int = 300) -> str:
    """``text`` cut to about ``limit`` characters, saying how many were left out (error messages stay one line long
    whatever they quote)."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def brief(obj: object, limit: int = 80) -> str:
    """A bounded ``repr`` of ``obj`` for an error message (containers shortened element-wise, then ``clip``)."""
    r = reprlib.Repr()
    r.maxstring = r.maxother = limit
    return clip(r.repr(obj), limit)


def load_entry_point(spec: str) -> object:
    """Import ``"package.module:attr"`` (``attr`` may be dotted) and return the object (nothing is called).

    Raises:
        ValueError: ``spec`` is not ``'package.module:attr'``.
        ImportError, AttributeError: the module or the attribute does not exist.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not _DOTTED.match(module_name) or not _DOTTED.match(attr):
        raise ValueError(f"entry point {spec!r} must look like 'package.module:attr'")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def entry_point(*kinds: str) -> Callable[[R], R]:
    """Decorator: mark a function, class or object as an entry point of ``kinds`` (registry kinds such as
    ``"task"``, ``"policy"``, ``"generation backend"``), so a config may name it as ``"module:attr"``."""

    def mark(obj: R) -> R:
        setattr(obj, _MARK, (*getattr(obj, _MARK, ()), *kinds))
        return obj

    return mark


def _conforms(cls: type, base: type) -> bool:
    """``issubclass(cls, base)``; for a protocol with data members (no ``issubclass``), whether ``cls`` has every
    method the protocol declares."""
    try:
        return issubclass(cls, base)
    except TypeError:
        methods = {name for klass in base.__mro__ if klass.__module__ not in ("typing", "builtins")
                   for name, v in vars(klass).items() if callable(v) and not name.startswith("_")}
        return all(callable(getattr(cls, name, None)) for name in methods)


def _annotation(fn: object, name: str) -> type | None:
    """The class a function's annotation ``name`` names (a class, or a dotted name resolved in the function's module
    without evaluating anything), or None."""
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        return None
    ann = getattr(fn, "__annotations__", {}).get(name)
    if isinstance(ann, str):
        if not _DOTTED.match(ann.strip()):
            return None
        head, *rest = ann.strip().split(".")
        namespace = getattr(inspect.unwrap(fn), "__globals__", {})
        ann = namespace.get(head, getattr(builtins, head, None))
        for part in rest:
            ann = getattr(ann, part, None)
    return ann if isinstance(ann, type) else None


def returns(base: type) -> Accepts:
    """Kind check: a class conforming to ``base``, or a function annotated to return one."""

    def check(obj: object) -> bool:
        cls = obj if isinstance(obj, type) else _annotation(obj, "return")
        return cls is not None and _conforms(cls, base)

    return check


def takes(base: type) -> Accepts:
    """Kind check: a function whose first parameter is annotated with ``base`` (or a subclass)."""

    def check(obj: object) -> bool:
        try:
            first = next(iter(inspect.signature(obj).parameters))  # type: ignore[arg-type]
        except (TypeError, ValueError, StopIteration):
            return False
        cls = _annotation(obj, first)
        return cls is not None and issubclass(cls, base)

    return check


def subclass_of(base: type) -> Accepts:
    """Kind check: a subclass of ``base``."""
    return lambda obj: isinstance(obj, type) and issubclass(obj, base)


def instance_of(base: type) -> Accepts:
    """Kind check: an instance of ``base``."""
    return lambda obj: isinstance(obj, base)


def _describe(obj: object) -> str:
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    module = getattr(obj, "__module__", None)
    what = "class" if isinstance(obj, type) else type(obj).__name__.replace("_", " ")
    return f"{module}.{name} (a {what})" if name and module else f"a {type(obj).__name__}"


def checked_call(fn: Callable[..., R], /, *args: Any, what: str, expected: str = "", **kwargs: Any) -> R:
    """``fn(*args, **kwargs)`` after checking that its signature accepts those arguments.

    Raises:
        ConfigError: ``fn`` cannot take them (the message starts with ``what`` and names the expected signature).
    """
    from sara.config import ConfigError

    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as exc:
        shape = f"; it must be callable as {expected}" if expected else ""
        raise ConfigError(f"{what}: {_describe(fn)} cannot take the arguments it is given ({exc}){shape}") from None
    except ValueError:  # no signature to check (a builtin): the kind check already vouched for it
        pass
    return fn(*args, **kwargs)


class Registry(Generic[T]):
    """A name -> object mapping with duplicate checks, lazy ``"module:attr"`` entries and a kind check.

    Args:
        kind: What is registered (used in error messages and by ``entry_point``), e.g. ``"allocator"``.
        accepts: Kind check of an unregistered ``"module:attr"`` object (``returns``, ``subclass_of``,
            ``instance_of``); None = only objects marked ``entry_point(kind)``. Marked objects always pass.
        expects: What ``accepts`` accepts, for the error message, e.g. ``"a BudgetAllocator subclass"``.
        signature: How the registry's factories are called, for error messages, e.g. ``"(options, *, task, seed)"``.
    """

    def __init__(self, kind: str, *, accepts: Accepts | None = None, expects: str = "", signature: str = "") -> None:
        self.kind = kind
        self.accepts = accepts
        self.expects = expects
        self.signature = signature
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

    def is_kind(self, obj: object) -> bool:
        """Whether ``obj`` may be used as a ``"module:attr"`` entry of this registry (see the module docstring)."""
        return self.kind in getattr(obj, _MARK, ()) or (self.accepts is not None and bool(self.accepts(obj)))

    def get(self, name: str) -> T:
        """Look up ``name``; a ``"module:attr"`` name not registered is imported and kind-checked (not called).

        Raises:
            KeyError: unknown name, an import that fails, or an object of another kind (the message says which
                and what is expected).
        """
        if name in self._items:
            obj = self._items[name]
            if isinstance(obj, str):
                obj = load_entry_point(obj)  # type: ignore[assignment]
                self._items[name] = obj
            return obj  # type: ignore[return-value]
        if ":" not in name:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        try:
            obj = load_entry_point(name)
        except Exception as exc:  # noqa: BLE001 - importing user code can fail in any way
            why = str(exc) or type(exc).__name__
            raise KeyError(f"unknown {self.kind} {name!r} ({why}); known: {', '.join(self.names())}") from None
        if not self.is_kind(obj):
            must = f"{self.expects}, or " if self.expects else ""
            raise KeyError(f"{self.kind} {name!r}: {_describe(obj)} is no {self.kind} entry point, so it was not "
                           f"called (importing its module ran that module's code); a 'module:attr' {self.kind} must "
                           f"be {must}an object marked with @sara.registry.entry_point({self.kind!r})")
        return obj  # type: ignore[return-value]

    def factory(self, name: str, *, what: str) -> Callable[..., Any]:
        """The factory ``name``, kind-checked (``get``) and wrapped in ``checked_call``: a call its signature cannot
        take is a ``ConfigError`` starting with ``what`` (e.g. ``"train config: field 'policy'"``) and naming the
        registry's ``signature``.

        Raises:
            ConfigError: unknown name, or an entry point of another kind (the message starts with ``what``).
        """
        from sara.config import ConfigError

        try:
            obj = self.get(name)
        except KeyError as exc:
            raise ConfigError(f"{what}: {exc.args[0]}") from None
        return functools.partial(checked_call, obj, what=what, expected=f"{name}{self.signature}")  # type: ignore

    def from_spec(self, spec: str) -> tuple[T, dict[str, str]]:
        """Parse ``"name:key=value,..."`` and look the name up; ``(object, options)``.

        Raises:
            ConfigError: unknown name (the message lists the known ones), an entry point of another kind, or a
                malformed spec.
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
