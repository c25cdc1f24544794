"""Old import paths kept for users: a module ``__getattr__`` that resolves moved names lazily, with a warning.

The new module is imported by name on first access (``importlib``), never at import time, so an alias kept in a lower
layer (``sara.allocators.tree.TreeSimulatedEnv`` -> ``sara.envs.sim.tree``) adds no import edge between layers.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["moved"]


def moved(old: str, names: Mapping[str, str] | str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``old``: ``names`` maps each moved name to its new module (or one module for all).

    Usage, at the end of the old module: ``__getattr__ = moved(__name__, {"TreeSimulatedEnv": "sara.envs.sim.tree"})``.
    """

    def __getattr__(name: str) -> Any:
        new = names if isinstance(names, str) else names.get(name)
        if new is None or name.startswith("__"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        module = importlib.import_module(new)
        if not hasattr(module, name):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        warnings.warn(f"{old}.{name} moved to {new}.{name}; import it from there", DeprecationWarning, stacklevel=2)
        return getattr(module, name)

    return __getattr__
