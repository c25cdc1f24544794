"""Deprecated path: the binary simulator lives in ``sara.envs.sim.binary`` (also exported by ``sara.envs``)."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_NEW = "sara.envs.sim.binary"


def __getattr__(name: str) -> Any:
    module = importlib.import_module(_NEW)
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"{__name__}.{name} moved to {_NEW}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(module, name)
