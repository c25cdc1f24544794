"""Cutting a round into per-worker shards: expected tokens per prompt (``TokenEstimator``) and a greedy
longest-processing-time split (``split_round``). Pure Python + numpy, no Ray."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["TokenEstimator", "split_round"]


class TokenEstimator:
    """Running mean of generated tokens per completion, per prompt key, with a global fallback.

    Args:
        default: Tokens assumed for a prompt before anything was observed (e.g. ``max_new_tokens``).
        max_keys: Keys remembered (oldest forgotten first).
    """

    def __init__(self, default: float = 1.0, max_keys: int = 100_000) -> None:
        self.default = float(default)
        self.max_keys = max_keys
        self._sum: dict[Any, float] = {}
        self._count: dict[Any, int] = {}
        self._gsum = 0.0
        self._gcount = 0

    def expected(self, key: Any, default: float | None = None) -> float:
        """Expected tokens per completion for ``key``: its mean, else the global mean, else ``default``."""
        c = self._count.get(key)
        if c:
            return self._sum[key] / c
        if self._gcount:
            return self._gsum / self._gcount
        return self.default if default is None else float(default)

    def observe(self, key: Any, tokens: Sequence[int]) -> None:
        """Fold in the token counts of completions of ``key``."""
        if not tokens:
            return
        s = float(sum(tokens))
        if key not in self._count and len(self._count) >= self.max_keys:
            oldest = next(iter(self._count))
            del self._count[oldest], self._sum[oldest]
        self._sum[key] = self._sum.get(key, 0.0) + s
        self._count[key] = self._count.get(key, 0) + len(tokens)
        self._gsum += s
        self._gcount += len(tokens)


def split_round(costs: Sequence[float], counts: Sequence[int], num_workers: int, *,
                split_requests: bool = True) -> list[list[tuple[int, int, int]]]:
    """Cut one round into per-worker shards of about equal expected cost.

    Greedy longest-processing-time assignment (each piece, costliest first, goes to the least loaded worker; ties to
    the lowest worker index); a request costlier than a fair share (total / workers) is first cut by seeds into
    near-equal pieces when ``split_requests``. Deterministic.

    Args:
        costs: Expected cost of each request ``[m]`` (e.g. rollouts × expected tokens per rollout).
        counts: Rollouts of each request ``[m]``.
        num_workers: Number of shards.
        split_requests: Allow cutting a request's seeds across workers.

    Returns:
        ``shards[w]`` = pieces ``(request index, seed start, seed stop)`` for worker ``w``, in request order.
    """
    costs_a = np.asarray(costs, np.float64)
    counts_a = np.asarray(counts, np.int64)
    pieces: list[tuple[float, int, int, int]] = []  # (cost, request, start, stop)
    share = costs_a.sum() / num_workers if len(costs_a) else 0.0
    for i, (c, n) in enumerate(zip(costs_a.tolist(), counts_a.tolist())):
        if n == 0:
            continue
        parts = min(n, math.ceil(c / share - 1e-9)) if split_requests and share > 0 and c > share else 1
        bounds = np.linspace(0, n, parts + 1).round().astype(np.int64)
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            pieces.append((c * (b - a) / n, i, a, b))
    pieces.sort(key=lambda p: (-p[0], p[1], p[2]))
    load = np.zeros(num_workers)
    shards: list[list[tuple[int, int, int]]] = [[] for _ in range(num_workers)]
    for cost, i, a, b in pieces:
        w = int(np.argmin(load))
        load[w] += cost
        shards[w].append((i, a, b))
    return [sorted(s) for s in shards]
