"""Uniform allocation and DAPO-style Dynamic Sampling: whole groups of k, every rollout of a group started together.

A unit's k rollouts are dispatched at once; fresh prompts are admitted while the groups in flight are not expected
to cover the groups still needed: ``uniform`` admits exactly the groups still needed (every group goes to the batch),
``ds`` admits ``ceil(groups still needed / effective fraction)`` minus the groups in flight, its fraction estimated
from the step's finished groups. Under synchronous rounds that is DAPO's refill loop (a generation batch of full
groups, keep the effective ones, refill); under a streaming driver the same rule admits as slots free up, the way
asynchronous RL systems run it.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field

from sara.allocators.base import AllocatorConfig, BudgetAllocator
from sara.types import Decision
from sara.units import UnitStatus

__all__ = ["UniformAllocator", "DynamicSamplingAllocator", "DynamicSamplingConfig"]


class _FullGroupAllocator(BudgetAllocator):
    """Generates full size-k groups; ``keep`` says which complete groups go to the batch."""

    def keep(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask over complete groups ``ids``: which go to the batch."""
        return np.ones(len(ids), bool)

    def groups_wanted(self) -> int:
        """Groups the step wants in flight now (``uniform``: exactly the groups still needed)."""
        return self.needed()

    def max_units(self) -> int | None:
        """Units a step admits at most (None = no cap)."""
        return None

    def demand(self) -> tuple[np.ndarray, np.ndarray]:
        """Every open group gets all its k rollouts at once, until the target is covered (then the step ends)."""
        ids = np.flatnonzero(self.units.status == UnitStatus.PROBING)
        want = self.k - self.units.n[ids] if self.needed() > 0 else np.zeros(len(ids), np.int64)
        return ids, want

    def wants_prompts(self, idle: int) -> int:
        """``groups_wanted`` minus the groups in flight, at most one per k idle slots (every admitted group starts
        all k rollouts at once), within the budget and ``max_units``."""
        if idle <= 0 or self.needed() == 0:
            return 0
        open_ = int((self.units.status == UnitStatus.PROBING).sum())
        want = min(self.groups_wanted() - open_, math.ceil(idle / self.k))
        cap = self._affordable_units()
        if cap is not None:
            want = min(want, cap)
        most = self.max_units()
        if most is not None:
            want = min(want, most - len(self.units))
        return max(0, want)

    def observe(self, unit_ids: np.ndarray, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        touched = self.units.update(unit_ids, rewards)
        self._counters["rollouts"] += len(rewards)
        full = touched[self.units.n[touched] >= self.k]
        self._counters["decisions"] += len(full)
        dec = np.where(self.keep(full), Decision.COMMIT, Decision.DISCARD).astype(np.int8)
        return full, self._close(full, dec)


class UniformAllocator(_FullGroupAllocator):
    """B prompts x k rollouts; every group goes to the batch, saturated ones included."""

    name = "uniform"
    Config = AllocatorConfig


class DynamicSamplingConfig(AllocatorConfig):
    """Options of DAPO's dynamic sampling."""

    gen_batch_prompts: int | None = Field(None, ge=1)
    """Prompts per generation batch (groups kept in flight; each gets k rollouts). None = the number of groups still
    needed, divided by ``expected_effective`` (so one batch usually suffices)."""
    expected_effective: float | None = Field(None, gt=0.0, le=1.0)
    """Effective-group fraction used to size a batch when gen_batch_prompts is None: a batch is
    ceil(groups still needed / expected_effective) prompts. None = estimate it from this step's finished groups (the
    first batch is exactly the number of groups needed, DAPO's refill loop)."""
    max_oversample: float = Field(64.0, ge=1.0, le=64.0)
    """Most prompts a generation batch holds per group still needed (streaming: groups kept in flight), when sized
    from the effective-fraction estimate: the estimate is floored at 1 / this. A noisy early estimate (no effective
    group among the first few) would otherwise size a batch at up to 64x what is needed, and its surplus becomes the
    next step's batch (``sara.train.bank``; docs/training.md has the measurement behind the default)."""
    max_gen_batches: int = Field(64, ge=1)
    """A step draws at most this many generation batches' worth of prompts (a batch: ``gen_batch_prompts``, else the
    step's target + lookahead), then returns what it has (status 'allocator_done'): DAPO's cap on generation batches,
    counted in prompts so it means the same in rounds and streaming."""


class DynamicSamplingAllocator(_FullGroupAllocator):
    """DAPO dynamic sampling: generate batches of full groups, keep the effective ones (std > eps), refill."""

    name = "ds"
    Config = DynamicSamplingConfig
    config: DynamicSamplingConfig

    def effective_fraction(self) -> float:
        """``expected_effective``, or the step's committed share of finished groups so far, smoothed as
        ``(committed + 0.5) / (finished + 1)`` (1.0 before any), at least ``1 / max_oversample``."""
        share = self.config.expected_effective
        if share is None:
            st = self.units.status
            done = int(((st == UnitStatus.COMMITTED) | (st == UnitStatus.DISCARDED)).sum())
            share = (int((st == UnitStatus.COMMITTED).sum()) + 0.5) / (done + 1.0) if done else 1.0
        return max(share, 1.0 / self.config.max_oversample)

    def groups_wanted(self) -> int:
        """``gen_batch_prompts`` when set, else ``ceil(groups still needed / effective fraction)``."""
        if self.config.gen_batch_prompts is not None:
            return self.config.gen_batch_prompts
        return max(1, math.ceil(self.needed() / self.effective_fraction()))

    def max_units(self) -> int:
        batch = self.config.gen_batch_prompts or max(self.target_groups + self.lookahead, 1)
        return self.config.max_gen_batches * batch

    def keep(self, ids: np.ndarray) -> np.ndarray:
        return self.units.std(ids) > self.config.internals.eps
