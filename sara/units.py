"""The per-step unit table of an allocator: one row per allocation unit (a prompt, or a tree), every column a numpy
array; and the read-only view a stopping rule decides on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

__all__ = ["Effectiveness", "UnitStatus", "UnitTable", "UnitView"]


class UnitStatus:
    """Status codes of the unit table (``np.int8``)."""

    PROBING = 0
    FILLING = 1
    COMMITTED = 2
    ABANDONED = 3
    DISCARDED = 4
    CARRIED = 5
    """Open at the step's end and handed to the next step by the driver (``carry_out``): not closed, not in this
    step's observations."""


@dataclass
class UnitTable:
    """Per-unit arrays of one step. Unit ids are row indices (0, 1, 2, ... in admission order).

    Attributes:
        pool_index: Prompt index in the pool, ``[M] int64``.
        n: Rollouts observed, ``[M] int64``.
        rsum: Sum of rewards, ``[M] float64`` (successes for binary rewards).
        rsq: Sum of squared rewards, ``[M] float64``.
        rmin / rmax: Running min / max reward, ``[M] float64``.
        status: ``UnitStatus`` code, ``[M] int8``.
        probes: Probing rounds the unit has been through, ``[M] int64``.
        inflight: Rollouts dispatched and neither delivered nor aborted, ``[M] int64``.
        prior: Per-unit prior parameters (e.g. ``{"alpha0": [M], "beta0": [M]}``), set at admission.
        extra: Free per-unit arrays for subclasses (tree parent ids, depth, ...).
    """

    pool_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    n: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    rsum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    rsq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    rmin: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    rmax: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    status: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    probes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    inflight: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prior: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.n)

    def add(self, pool_index: np.ndarray, prior: Mapping[str, np.ndarray] | None = None,
            extra: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """Append units for ``pool_index``; returns their unit ids."""
        m = len(pool_index)
        start = len(self)
        self.pool_index = np.concatenate([self.pool_index, np.asarray(pool_index, np.int64)])
        self.n = np.concatenate([self.n, np.zeros(m, np.int64)])
        self.rsum = np.concatenate([self.rsum, np.zeros(m)])
        self.rsq = np.concatenate([self.rsq, np.zeros(m)])
        self.rmin = np.concatenate([self.rmin, np.full(m, np.inf)])
        self.rmax = np.concatenate([self.rmax, np.full(m, -np.inf)])
        self.status = np.concatenate([self.status, np.zeros(m, np.int8)])
        self.probes = np.concatenate([self.probes, np.zeros(m, np.int64)])
        self.inflight = np.concatenate([self.inflight, np.zeros(m, np.int64)])
        for table, given in ((self.prior, prior or {}), (self.extra, extra or {})):
            for key in set(table) | set(given):
                new = np.broadcast_to(np.asarray(given[key]), (m,)) if key in given else np.zeros(m)
                old = table.get(key, np.zeros(start, new.dtype))
                table[key] = np.concatenate([old, new.astype(old.dtype, copy=False)])
        return np.arange(start, start + m, dtype=np.int64)

    def update(self, unit_ids: np.ndarray, rewards: np.ndarray) -> np.ndarray:
        """Fold flat observations into the sufficient statistics; returns the distinct touched unit ids."""
        unit_ids = np.asarray(unit_ids, np.int64)
        rewards = np.asarray(rewards, np.float64)
        np.add.at(self.n, unit_ids, 1)
        np.add.at(self.rsum, unit_ids, rewards)
        np.add.at(self.rsq, unit_ids, rewards * rewards)
        np.minimum.at(self.rmin, unit_ids, rewards)
        np.maximum.at(self.rmax, unit_ids, rewards)
        if len(unit_ids) * 8 < len(self.n):
            return np.unique(unit_ids)
        seen = np.zeros(len(self.n), bool)  # many ids: a mask is linear where a sort is not (same sorted result)
        seen[unit_ids] = True
        return np.flatnonzero(seen)

    def std(self, idx: np.ndarray) -> np.ndarray:
        """Population std of each unit's rewards so far."""
        n = np.maximum(self.n[idx], 1)
        mean = self.rsum[idx] / n
        return np.sqrt(np.maximum(self.rsq[idx] / n - mean * mean, 0.0))


class Effectiveness(Protocol):
    """What a ``UnitView`` asks for its ``p_eff`` (``sara.allocators.effectiveness``)."""

    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray: ...


@dataclass(frozen=True)
class UnitView:
    """Read-only view of some units handed to a stopping rule (``SequentialAllocator.decide``).

    Attributes:
        ids: Unit ids ``[m]``.
        n: Rollouts observed ``[m]``.
        s: Reward sums ``[m]`` (successes for binary rewards).
        k: Full group size.
        table: The whole unit table (for rules that need more columns).
        model: The effectiveness model behind ``p_eff``.
    """

    ids: np.ndarray
    n: np.ndarray
    s: np.ndarray
    k: int
    table: UnitTable
    model: Effectiveness

    @cached_property
    def p_eff(self) -> np.ndarray:
        """Predictive probability that each unit's completed group is effective ``[m]`` (computed on first use)."""
        return self.model.p_effective(self.table, self.ids, self.k)
