"""Conformance checks users run on their own allocators, tasks and backends.

``check_allocator`` lives in ``sara.testing.allocator`` (its boundary leg, ``check_boundary``, in
``sara.testing.boundary``), ``check_task`` in ``sara.testing.task`` and
``check_backend`` in ``sara.testing.backend``; ``ScriptedBackend`` (a backend without a model, for tests of tasks and
environments) in ``sara.testing.scripted``. They are imported on first use so ``import sara.testing`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "check_allocator": "sara.testing.allocator",
    "check_boundary": "sara.testing.boundary",
    "check_task": "sara.testing.task",
    "check_backend": "sara.testing.backend",
    "ScriptedBackend": "sara.testing.scripted",
    "StreamingScriptedBackend": "sara.testing.scripted",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'sara.testing' has no attribute {name!r}")
