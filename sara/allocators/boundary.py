"""The allocator protocol's boundary: what every call into a ``BudgetAllocator`` is checked against before it is used.

The driver, the integrations (verl's environment, TRL) and a user's own loop all reach an allocator through the same
public methods of ``sara.allocators.base.BudgetAllocator``; those methods check their arguments here, once, before
anything is folded in, so no allocator sees a non-finite reward, a reward outside its declared range, arrays of
different lengths or a unit id that is not one of the step's units. A rejected call changes nothing and raises a
``ProtocolError`` whose one line names the allocator, the method, the rollout (unit, index, prompt) and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sized
from typing import cast

import numpy as np
import numpy.typing as npt

from sara.config import SaraError

__all__ = ["ProtocolError", "as_count", "as_ids", "check_rewards", "check_same_length"]


class ProtocolError(SaraError, ValueError):
    """A call broke the allocator protocol (a bad reward, arrays that do not match, an unknown unit id); the message
    names the allocator, the method and the rollout."""


def _array(values: npt.ArrayLike, who: str, what: str) -> np.ndarray:
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{who}: {what} is not an array ({exc})") from None
    if arr.ndim != 1:
        raise ProtocolError(f"{who}: {what} must be a 1-D array, got shape {arr.shape}")
    return arr


def as_ids(values: npt.ArrayLike, who: str, what: str, *, below: int | None = None) -> npt.NDArray[np.int64]:
    """``values`` as a 1-D ``int64`` array of whole numbers ``>= 0`` (and ``< below`` when given).

    Raises:
        ProtocolError: not 1-D, not whole numbers (``1.5``, ``True``, text), negative, or not below ``below``.
    """
    arr = _array(values, who, what)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ProtocolError(f"{who}: {what} must be whole numbers, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr) | (arr != np.trunc(arr))
        if bad.any():
            raise ProtocolError(f"{who}: {what} must be whole numbers, got {arr[bad][0]!r} at position "
                                f"{int(np.flatnonzero(bad)[0])}")
    out = arr.astype(np.int64)
    low = out < 0
    if low.any():
        raise ProtocolError(f"{who}: {what} must be >= 0, got {int(out[low][0])} at position "
                            f"{int(np.flatnonzero(low)[0])}")
    if below is not None:
        high = out >= below
        if high.any():
            raise ProtocolError(f"{who}: {what} {int(out[high][0])} (position {int(np.flatnonzero(high)[0])}) is not "
                                f"one of this step's {below} units (ids 0..{below - 1}); pass the ids dispatch / "
                                "admit returned")
    return out


def as_count(value: object, who: str, what: str) -> int:
    """``value`` as an ``int >= 0`` (a whole number, not a bool).

    Raises:
        ProtocolError: not a whole number >= 0.
    """
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
    if not ok and isinstance(value, (float, np.floating)) and np.isfinite(value) and float(value).is_integer():
        ok = True
    number = cast("int | float | np.integer | np.floating", value)  # when ok
    if not ok or number < 0:
        raise ProtocolError(f"{who}: {what} must be a whole number >= 0, got {value!r}")
    return int(number)


def check_same_length(who: str, **arrays: Sized | None) -> None:
    """Every given (not None) array has the same length.

    Raises:
        ProtocolError: naming the arrays and their lengths.
    """
    lens = {name: len(a) for name, a in arrays.items() if a is not None}
    if len(set(lens.values())) > 1:
        shown = ", ".join(f"{name} has {n}" for name, n in lens.items())
        raise ProtocolError(f"{who}: the arrays must have one entry per delivered rollout ({shown})")


def check_rewards(values: npt.ArrayLike, who: str, bounds: tuple[float, float], where: Callable[[int], str]
                  ) -> npt.NDArray[np.float64]:
    """``values`` as 1-D ``float64`` rewards, each finite and inside ``bounds`` (inclusive).

    Args:
        values: The rewards.
        who: The allocator and method, for the message.
        bounds: ``(low, high)``; infinite ends mean any finite reward.
        where: ``i -> str`` naming rollout ``i`` (its unit, index and prompt).

    Raises:
        ProtocolError: naming the first bad rollout, its reward and the range.
    """
    arr = _array(values, who, "rewards")
    if arr.size and (arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer)
                                               or np.issubdtype(arr.dtype, np.floating))):
        raise ProtocolError(f"{who}: rewards must be numbers, got dtype {arr.dtype}")
    rewards = arr.astype(np.float64)
    low, high = bounds
    bad = ~np.isfinite(rewards) | (rewards < low) | (rewards > high)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        span = "finite" if not (np.isfinite(low) or np.isfinite(high)) else f"finite and in [{low:g}, {high:g}]"
        more = int(bad.sum()) - 1
        raise ProtocolError(f"{who}: {where(i)} has reward {float(rewards[i])!r}"
                            f"{f' (and {more} more bad rewards in this call)' if more else ''}; rewards must be {span}: "
                            "fix the verifier or the reward function that scored it")
    return rewards
