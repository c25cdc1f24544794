"""``check_boundary``: the allocator protocol refuses bad input at its boundary, whatever the allocator.

``check_allocator`` runs it on every allocator it checks, so an allocator that overrides a public method
(``finished``, ``abort``, ``carry_in``, ...) without calling ``super()`` first, and so skips the template's checks,
fails the conformance kit. Each bad call must raise ``sara.allocators.ProtocolError`` and leave the allocator's unit
table exactly as it was; a good call afterwards still works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sara.allocators.base import BudgetAllocator, ProtocolError

__all__ = ["check_boundary"]


def _snapshot(alloc: BudgetAllocator) -> dict[str, np.ndarray]:
    u = alloc.units
    cols = {name: getattr(u, name).copy() for name in ("pool_index", "n", "rsum", "rsq", "rmin", "rmax", "status",
                                                       "probes", "inflight")}
    return cols


def _ranks(ids: np.ndarray) -> np.ndarray:
    """Index of each dispatched rollout within its unit (0, 1, ... per unit, in order), as the driver numbers them."""
    order = np.argsort(ids, kind="stable")
    rank = np.empty(len(ids), np.int64)
    rank[order] = np.arange(len(ids)) - np.searchsorted(ids[order], ids[order], side="left")
    return rank


def _bad_calls(alloc: BudgetAllocator, ids: np.ndarray, j: np.ndarray
               ) -> list[tuple[str, Callable[[], Any]]]:
    """``(what, call)`` of calls the protocol must refuse, given the dispatched ``ids`` and their indices ``j``."""
    m = len(alloc.units)
    u0, j0 = ids[:1], j[:1]
    low, high = alloc.reward_range
    ok = np.array([0.0 if low <= 0.0 <= high else float(low if np.isfinite(low) else high)])
    calls: list[tuple[str, Callable[[], Any]]] = []
    for label, r in (("a nan reward", np.nan), ("an inf reward", np.inf), ("a -inf reward", -np.inf)):
        calls.append((label, lambda r=r: alloc.finished(u0, np.array([r]), j0)))
    if np.isfinite(high):
        calls.append(("a reward above reward_range", lambda: alloc.finished(u0, np.array([high + 1.0]), j0)))
    if np.isfinite(low):
        calls.append(("a reward below reward_range", lambda: alloc.finished(u0, np.array([low - 1.0]), j0)))
    calls += [
        ("a nan among good rewards", lambda: alloc.finished(ids, np.r_[np.full(len(ids) - 1, ok[0]), np.nan], j)),
        ("more rewards than unit ids", lambda: alloc.finished(u0, np.r_[ok, ok], j0)),
        ("fewer rewards than unit ids", lambda: alloc.finished(ids[:2], ok, j[:2]) if len(ids) >= 2
         else alloc.finished(u0, np.zeros(0), j0)),
        ("an index array of another length", lambda: alloc.finished(u0, ok, np.r_[j0, j0])),
        ("a negative index", lambda: alloc.finished(u0, ok, np.array([-1]))),
        ("a unit id past the step's units", lambda: alloc.finished(np.array([m]), ok, j0)),
        ("a negative unit id", lambda: alloc.finished(np.array([-1]), ok, j0)),
        ("a fractional unit id", lambda: alloc.finished(np.array([0.5]), ok, j0)),
        ("a boolean unit id", lambda: alloc.finished(np.array([True]), ok, j0)),
        ("a 2-D unit id array", lambda: alloc.finished(u0[:, None], ok, j0)),
        ("text rewards", lambda: alloc.finished(u0, np.array(["1"]), j0)),
        ("more rollouts of a unit than it has in flight",
         lambda: alloc.finished(np.repeat(u0, alloc.inflight(u0)[0] + 1), np.full(alloc.inflight(u0)[0] + 1, ok[0]),
                                np.arange(alloc.inflight(u0)[0] + 1))),
        ("abort of a unit id past the step's units", lambda: alloc.abort(np.array([m]))),
        ("abort of a negative unit id", lambda: alloc.abort(np.array([-1]))),
        ("inflight of a unit id past the step's units", lambda: alloc.inflight(np.array([m + 3]))),
        ("pool_indices of a negative unit id", lambda: alloc.pool_indices(np.array([-2]))),
        ("dispatch restricted to an unknown unit", lambda: alloc.dispatch(1, only=np.array([m]))),
        ("admit of a negative prompt index", lambda: alloc.admit(np.array([-1]))),
    ]
    if alloc.carries_over:
        calls += [
            ("carry_out of a unit id past the step's units", lambda: alloc.carry_out(np.array([m]))),
            ("carry_in with a nan reward", lambda: alloc.carry_in(np.array([0]), [np.array([np.nan])],
                                                                   np.array([0]))),
            ("carry_in with arrays of different lengths", lambda: alloc.carry_in(np.array([0, 1]), [ok],
                                                                                   np.array([0, 0]))),
        ]
    return calls


def check_boundary(make: Callable[[], BudgetAllocator], error: type[AssertionError] = AssertionError
                   ) -> dict[str, int]:
    """Check that ``make()``'s allocator refuses bad input with a ``ProtocolError`` and is unchanged by it.

    Args:
        make: Zero-argument factory of the allocator under test.
        error: Exception class raised on a violation (``check_allocator`` passes its ``AllocatorCheckError``).

    Returns:
        ``{"refused": number of bad calls refused}``.
    """
    alloc = make()
    name = type(alloc).__name__
    alloc.begin_step(4, step=0)
    alloc.admit(np.arange(8, dtype=np.int64))
    ids = alloc.dispatch(64)
    if len(ids) == 0:
        raise error(f"{name}: dispatched nothing for 8 admitted prompts and 64 free slots")
    j = _ranks(ids)
    refused = 0
    for what, call in _bad_calls(alloc, ids, j):
        before = _snapshot(alloc)
        try:
            call()
        except ProtocolError as exc:
            if "\n" in str(exc):
                raise error(f"{name}: the ProtocolError for {what} is not one line: {str(exc)[:200]!r}") from None
        except Exception as exc:  # noqa: BLE001 - any other failure is a violation, named
            raise error(f"{name}: {what} raised {type(exc).__name__} ({str(exc)[:200]}), expected a ProtocolError "
                        "from the protocol's boundary (call super() first in an overridden public method)") from None
        else:
            raise error(f"{name}: {what} was accepted; the protocol's boundary must refuse it with a ProtocolError "
                        "(call super() first in an overridden public method)")
        after = _snapshot(alloc)
        changed = [col for col in before if not np.array_equal(before[col], after[col], equal_nan=True)]
        if changed:
            raise error(f"{name}: {what} was refused but changed the unit table ({', '.join(changed)})")
        refused += 1
    low, high = alloc.reward_range
    good = np.full(len(ids), 0.0 if low <= 0.0 <= high else float(low if np.isfinite(low) else high))
    alloc.finished(ids, good, j)  # the same delivery, well formed, is still accepted
    return {"refused": refused}
