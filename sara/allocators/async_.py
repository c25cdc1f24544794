"""Asynchronous allocation: decide per finished rollout, without round barriers (streaming engines).

``sara_async`` is SARA with per-unit in-flight bookkeeping. Under ``sara.collect`` (synchronous rounds) it behaves
exactly like ``sara`` with one rollout per probe. A streaming driver (vLLM's async engine, or the event simulator
``sara.collect_async``) instead calls:

* ``dispatch(free)``: unit ids for the next ``free`` generation slots (filling units first, then probing units with
  fewer than ``max_inflight`` rollouts in flight); ``admit`` fresh prompts when it returns fewer than ``free``;
* ``finished(unit_ids, rewards)``: fold finished rollouts in and decide at once (the template's ``observe``);
* ``inflight(unit_ids)``: rollouts in flight per unit, so the driver can abort those of closed units;
* ``abort(unit_ids)``: forget the in-flight rollouts the driver cancelled; ``wants_slots(idle)``: fresh prompts to
  admit for idle slots.

The event simulator (``simulate_async`` / ``simulate_sync``) reads the allocator only through this public API. ``async_vs_sync`` (``sara.bench.beyond``) compares wall-clock per effective
group against synchronous rounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from sara.allocators.base import Prior
from sara.allocators.sara import SARAAllocator, SARAConfig
from sara.allocators.units import UnitStatus
from sara.deprecation import moved

__all__ = ["AsyncConfig", "AsyncSARAAllocator"]


class AsyncConfig(SARAConfig):
    """SARA's options plus the in-flight limit of a probing unit (streaming drivers only)."""

    max_inflight: int = Field(1, ge=1)
    """Rollouts a probing (undecided) unit may have in flight at once; 1 decides after every single rollout."""
    work_conserving: bool = True
    """Streaming drivers: while groups are still needed, admit fresh prompts into every idle slot (more probes in
    flight, fewer idle slots) instead of the template's sizing rule (``oversample``)."""


class AsyncSARAAllocator(SARAAllocator):
    """``sara_async``: SARA's rule applied per finished rollout; see the module docstring for the streaming API."""

    name = "sara_async"
    Config = AsyncConfig
    config: AsyncConfig

    def __init__(self, config: AsyncConfig | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 **overrides: Any) -> None:
        super().__init__(config, prior=prior, **overrides)
        self._inflight = np.zeros(0, np.int64)

    def begin_step(self, target_groups: int, step: int | None = None, **kwargs: Any) -> None:
        super().begin_step(target_groups, step, **kwargs)
        self._inflight = np.zeros(0, np.int64)

    def admit(self, pool_index: np.ndarray) -> np.ndarray:
        ids = super().admit(pool_index)
        self._inflight = np.concatenate([self._inflight, np.zeros(len(ids), np.int64)])
        return ids

    def inflight(self, unit_ids: np.ndarray) -> np.ndarray:
        """Rollouts in flight per unit."""
        return self._inflight[np.asarray(unit_ids, np.int64)]

    def wants_slots(self, idle: int) -> int:
        """Fresh prompts to admit when ``idle`` slots found no work among the open units (streaming drivers)."""
        if idle <= 0 or self._needed() == 0:
            return 0
        return idle if self.config.work_conserving else min(idle, self.wants_prompts())

    def dispatch(self, free: int) -> np.ndarray:
        """Unit ids (with repeats) for up to ``free`` rollouts to start now; marks them in flight."""
        u, k = self.units, self.k
        if free <= 0 or len(u) == 0:
            return np.zeros(0, np.int64)
        fill = np.flatnonzero(u.status == UnitStatus.FILLING)
        fill_need = np.maximum(k - u.n[fill] - self._inflight[fill], 0)
        probe = np.flatnonzero(u.status == UnitStatus.PROBING)
        probe_need = np.maximum(np.minimum(self.config.max_inflight, k - u.n[probe]) - self._inflight[probe], 0)
        ids = np.concatenate([np.repeat(fill, fill_need), np.repeat(probe, probe_need)])[:free]
        np.add.at(self._inflight, ids, 1)
        return ids

    def finished(self, unit_ids: np.ndarray, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fold finished rollouts in (``unit_ids`` may repeat) and return the units closed now."""
        unit_ids = np.asarray(unit_ids, np.int64)
        np.subtract.at(self._inflight, unit_ids, 1)
        return self.observe(unit_ids, rewards)

    def abort(self, unit_ids: np.ndarray) -> None:
        """Forget the in-flight rollouts of ``unit_ids`` (the driver cancelled them)."""
        self._inflight[np.asarray(unit_ids, np.int64)] = 0


# Moved (deprecated paths, resolved lazily so the allocators never import the drivers, simulators or benchmarks).
__getattr__ = moved(__name__, {"LatencyModel": "sara.envs.sim.latency", "SimResult": "sara.collect_async",
                               "simulate_async": "sara.collect_async", "simulate_sync": "sara.collect_async",
                               "async_vs_sync": "sara.bench.beyond"})
