"""Uniform allocation and DAPO-style Dynamic Sampling: whole groups of k, generated in batches.

Under a streaming driver (``sara.collect_stream``) they stream too (the streaming API of
``sara.allocators.streaming``): a unit's k rollouts are dispatched together, fresh prompts are admitted as slots free
up (``wants_slots``) instead of batch by batch, the step ends once the target is committed (groups still generating
are aborted, or carried into the next step with ``carry_lag``). ``uniform`` admits exactly the groups still needed;
``ds`` admits ``ceil(groups still needed / effective fraction)`` minus the groups in flight, its fraction estimated
from the step's finished groups as its batches are sized (streaming ``ds`` is DAPO's refill loop without batch
barriers, the way asynchronous RL systems run it).
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field

from sara.allocators.base import AllocatorConfig, BudgetAllocator, UnitStatus
from sara.allocators.streaming import StreamingMixin
from sara.types import Decision

__all__ = ["UniformAllocator", "DynamicSamplingAllocator", "DynamicSamplingConfig"]


class _FullGroupAllocator(StreamingMixin, BudgetAllocator):
    """Generates full size-k groups, one generation batch per round; ``keep`` says which groups go to the batch.

    Streaming (``wants_slots`` / ``dispatch`` / ``finished``): every open unit gets its k rollouts at once, fresh
    prompts are admitted while the groups in flight are not expected to cover the groups still needed."""

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

    def _effective_fraction(self) -> float:
        """Expected fraction of fresh groups that go to the batch (sizes streaming admission)."""
        return 1.0

    def _max_units(self) -> int | None:
        """Units a streaming step admits at most (None = no cap)."""
        return None

    # streaming (sara.allocators.streaming) ---------------------------------------------------------------------
    def probe_inflight(self, unit_ids: np.ndarray) -> np.ndarray:
        """All k rollouts of a group are started together."""
        return np.full(len(unit_ids), self.k, np.int64)

    def _drained(self, probing: np.ndarray) -> np.ndarray:
        """Once the target is covered no open group gets more rollouts (the step ends)."""
        return np.zeros(len(probing), bool)

    def _groups_in_flight_wanted(self) -> int:
        """Groups a streaming step wants open: ``ceil(needed / effective fraction)``."""
        return math.ceil(self._needed() / max(self._effective_fraction(), 1.0 / 64) - 1e-9)

    def wants_slots(self, idle: int) -> int:
        """Fresh prompts for ``idle`` slots: ``_groups_in_flight_wanted`` minus the groups in flight, at most one per
        k idle slots (every admitted group starts all k rollouts soon), within the budget and ``_max_units``."""
        if idle <= 0 or self._needed() == 0:
            return 0
        open_ = int((self.units.status == UnitStatus.PROBING).sum())
        want = min(self._groups_in_flight_wanted() - open_, math.ceil(idle / self.k))
        cap = self._affordable_units()
        if cap is not None:
            want = min(want, cap)
        most = self._max_units()
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
    """B prompts x k rollouts in one round; every group goes to the batch, saturated ones included."""

    name = "uniform"
    Config = AllocatorConfig


class DynamicSamplingConfig(AllocatorConfig):
    """Options of DAPO's dynamic sampling."""

    gen_batch_prompts: int | None = Field(None, ge=1)
    """Prompts per generation batch (each gets k rollouts). None = the number of groups still needed, divided by
    ``expected_effective`` (so one batch usually suffices). Streaming drivers: groups kept in flight."""
    expected_effective: float | None = Field(None, gt=0.0, le=1.0)
    """Effective-group fraction used to size a batch when gen_batch_prompts is None: a batch is
    ceil(groups still needed / expected_effective) prompts. None = estimate it from this step's batches so far (the
    first batch is exactly the number of groups needed, DAPO's refill loop)."""
    max_oversample: float = Field(8.0, ge=1.0, le=64.0)
    """Most prompts a generation batch holds per group still needed (streaming: groups kept in flight), when sized
    from the effective-fraction estimate: the estimate is floored at 1 / this. A noisy early estimate (no effective
    group among the first few) would otherwise size a batch at up to 64x what is needed, and its surplus becomes the
    next step's batch (``sara.train.bank``; docs/training.md has the measurement behind the default)."""
    max_gen_batches: int = Field(64, ge=1)
    """Stop after this many generation batches and return what was collected (status 'allocator_done'). Streaming
    drivers: stop admitting after as many prompts as this many batches of the step's target would hold."""


class DynamicSamplingAllocator(_FullGroupAllocator):
    """DAPO dynamic sampling: generate batches of full groups, keep the effective ones (std > eps), refill."""

    name = "ds"
    Config = DynamicSamplingConfig
    config: DynamicSamplingConfig

    def _batch_size(self) -> int:
        if self.config.gen_batch_prompts is not None:
            return self.config.gen_batch_prompts
        return max(1, math.ceil(self._needed() / max(self._effective_fraction(), 1.0 / 64)))

    def _effective_fraction(self) -> float:
        """``expected_effective``, or the step's committed share of finished groups so far (1.0 before any), at least
        ``1 / max_oversample``."""
        if self.config.expected_effective is not None:
            return self.config.expected_effective
        st = self.units.status
        done = int(((st == UnitStatus.COMMITTED) | (st == UnitStatus.DISCARDED)).sum())
        share = (int((st == UnitStatus.COMMITTED).sum()) + 0.5) / (done + 1.0) if done else 1.0
        return max(share, 1.0 / self.config.max_oversample)

    def _max_batches(self) -> int:
        return self.config.max_gen_batches

    def _max_units(self) -> int:
        return self.config.max_gen_batches * max(self.target_groups + self.lookahead, 1)

    def _groups_in_flight_wanted(self) -> int:
        """``gen_batch_prompts`` when set (that many groups kept in flight), else the estimate's."""
        if self.config.gen_batch_prompts is not None:
            return self.config.gen_batch_prompts
        return super()._groups_in_flight_wanted()

    def keep(self, ids: np.ndarray) -> np.ndarray:
        return self.units.std(ids) > self.config.eps
