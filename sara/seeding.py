"""Deterministic, vectorized seed derivation (SplitMix64 mixing in numpy).

A rollout's seed is a pure function of ``(base seed, step, pool index, occurrence, rollout index)``, so the same
rollout gets the same seed whatever round it is generated in, whichever worker generates it, and after a resume.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["mix64", "derive_seeds", "uniform_from_seeds"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: ArrayLike) -> np.ndarray:
    """SplitMix64 finalizer, elementwise over a uint64 array (wrapping arithmetic)."""
    z = np.array(x, dtype=np.uint64, copy=True, ndmin=1)
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        z = z ^ (z >> np.uint64(31))
    return z


def derive_seeds(*keys: ArrayLike) -> np.ndarray:
    """Hash any number of broadcastable integer key arrays into uint64 seeds (order matters)."""
    arrays = np.broadcast_arrays(*(np.asarray(k).astype(np.int64).astype(np.uint64) for k in keys))
    h = np.zeros(arrays[0].shape, np.uint64).reshape(-1)
    for a in arrays:
        h = mix64(h ^ mix64(a.reshape(-1)))
    return h.reshape(arrays[0].shape)


def uniform_from_seeds(seeds: ArrayLike, stream: int = 0) -> np.ndarray:
    """A U[0, 1) draw per seed (53-bit mantissa); ``stream`` gives independent draws from the same seed."""
    h = derive_seeds(np.asarray(seeds, np.uint64).astype(np.int64), stream)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
