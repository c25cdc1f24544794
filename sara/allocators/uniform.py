"""Uniform allocation and DAPO-style Dynamic Sampling: whole groups of k, generated in batches."""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field

from sara.allocators.base import AllocatorConfig, BudgetAllocator, UnitStatus
from sara.types import Decision

__all__ = ["UniformAllocator", "DynamicSamplingAllocator", "DynamicSamplingConfig"]


class _FullGroupAllocator(BudgetAllocator):
    """Generates full size-k groups, one generation batch per round; ``keep`` says which groups go to the batch."""

    def _batch_size(self) -> int:
        return self.target_groups

    def _max_batches(self) -> int:
        return 1

    def begin_step(self, target_groups: int, step: int | None = None, max_rollouts: int | None = None) -> None:
        super().begin_step(target_groups, step, max_rollouts)
        self.batches = 0

    def wants_prompts(self) -> int:
        open_ = int((self.units.status <= UnitStatus.FILLING).sum())
        if open_ or self._needed() == 0 or self.batches >= self._max_batches():
            return 0
        self.batches += 1
        cap = self._affordable_units()
        return self._batch_size() if cap is None else min(self._batch_size(), max(cap, 1))

    def plan(self) -> tuple[np.ndarray, np.ndarray]:
        ids = np.flatnonzero(self.units.status == UnitStatus.PROBING)
        counts = self.k - self.units.n[ids]
        keep = counts > 0
        return ids[keep], counts[keep]

    def keep(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask over complete groups ``ids``: which go to the batch."""
        return np.ones(len(ids), bool)

    def observe(self, unit_ids: np.ndarray, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        touched = self.units.update(unit_ids, rewards)
        self._counters["rollouts"] += len(rewards)
        full = touched[self.units.n[touched] >= self.k]
        self._counters["decisions"] += len(full)
        dec = np.where(self.keep(full), Decision.COMMIT, Decision.DISCARD).astype(np.int8)
        return full, self._close(full, dec)


class UniformAllocator(_FullGroupAllocator):
    """B prompts x k rollouts in one round; every group goes to the batch, saturated ones included."""

    name = "uniform"
    Config = AllocatorConfig


class DynamicSamplingConfig(AllocatorConfig):
    """Options of DAPO's dynamic sampling."""

    gen_batch_prompts: int | None = Field(None, ge=1)
    """Prompts per generation batch (each gets k rollouts). None = the number of groups still needed, divided by
    ``expected_effective`` (so one batch usually suffices)."""
    expected_effective: float | None = Field(None, gt=0.0, le=1.0)
    """Effective-group fraction used to size a batch when gen_batch_prompts is None: a batch is
    ceil(groups still needed / expected_effective) prompts. None = estimate it from this step's batches so far (the
    first batch is exactly the number of groups needed, DAPO's refill loop)."""
    max_gen_batches: int = Field(64, ge=1)
    """Stop after this many generation batches and return what was collected (status 'allocator_done')."""


class DynamicSamplingAllocator(_FullGroupAllocator):
    """DAPO dynamic sampling: generate batches of full groups, keep the effective ones (std > eps), refill."""

    name = "ds"
    Config = DynamicSamplingConfig
    config: DynamicSamplingConfig

    def _batch_size(self) -> int:
        if self.config.gen_batch_prompts is not None:
            return self.config.gen_batch_prompts
        frac = self.config.expected_effective
        if frac is None:
            st = self.units.status
            done = int((st >= UnitStatus.COMMITTED).sum())
            frac = (int((st == UnitStatus.COMMITTED).sum()) + 0.5) / (done + 1.0) if done else 1.0
        return max(1, math.ceil(self._needed() / max(frac, 1.0 / 64)))

    def _max_batches(self) -> int:
        return self.config.max_gen_batches

    def keep(self, ids: np.ndarray) -> np.ndarray:
        return self.units.std(ids) > self.config.eps
