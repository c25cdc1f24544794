"""Tree node handles: how ``sara_tree`` tells a tree-aware environment which branch node each leaf grows under.

A handle is sent as a request's ``prefix`` instead of text: ``<tree:STEP.UNIT:B:+0,0,+1>`` names the tree (step and
unit id), its number of branch nodes ``B`` and, per leaf of the request, its branch node (``+`` = this leaf opens the
branch). The allocator writes handles (``sara.allocators.tree``); ``TreeSimulatedEnv`` and ``TreeTaskEnv`` read them.
A request whose prefix is not a handle is an independent rollout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["format_handle", "parse_handle"]

_HANDLE = re.compile(r"^<tree:(\d+)\.(\d+):(\d+):(\+?\d+(?:,\+?\d+)*)>$")


def format_handle(step: int, unit: int, branches: int, leaves: Sequence[int], opens: Sequence[bool]) -> str:
    """Node handle of one request: the branch node of each leaf, ``+`` where the leaf opens its branch."""
    body = ",".join(("+" if o else "") + str(int(c)) for c, o in zip(leaves, opens))
    return f"<tree:{int(step)}.{int(unit)}:{int(branches)}:{body}>"


def parse_handle(prefix: str) -> tuple[int, int, int, list[int], list[bool]] | None:
    """``(step, unit, branches, leaf branches, opens)`` of a node handle, or None for anything else."""
    m = _HANDLE.match(prefix) if prefix else None
    if m is None:
        return None
    items = m.group(4).split(",")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3)), [int(x.lstrip("+")) for x in items],
            [x.startswith("+") for x in items])
