"""Asynchronous allocation: decide per finished rollout, without round barriers (streaming engines).

``sara_async`` is SARA with its own in-flight limit (``max_inflight``) and admission rule (``work_conserving``) for
streaming drivers; the streaming API and its in-flight bookkeeping are the sequential template's
(``sara.allocators.streaming``), so ``sara`` and ``bayes_optimal`` stream too. Under ``sara.collect`` (synchronous
rounds) it behaves exactly like ``sara`` with one rollout per probe. A streaming driver (``sara.collect_stream`` on an
engine, or the event simulator ``sara.collect_async``) calls:

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

import numpy as np
from pydantic import Field

from sara.allocators.sara import SARAAllocator, SARAConfig
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
    """``sara_async``: SARA's rule applied per finished rollout, with its own in-flight limit and admission rule for
    streaming drivers (the streaming API itself is the template's, ``sara.allocators.streaming``)."""

    name = "sara_async"
    Config = AsyncConfig
    config: AsyncConfig

    def probe_inflight(self, unit_ids: np.ndarray) -> np.ndarray:
        """``max_inflight`` for every probing unit."""
        return np.full(len(unit_ids), self.config.max_inflight, np.int64)

    def wants_slots(self, idle: int) -> int:
        """Fresh prompts to admit when ``idle`` slots found no work among the open units (streaming drivers)."""
        if idle <= 0 or self._needed() == 0:
            return 0
        return idle if self.config.work_conserving else min(idle, self.wants_prompts())


# Moved (deprecated paths, resolved lazily so the allocators never import the drivers, simulators or benchmarks).
__getattr__ = moved(__name__, {"LatencyModel": "sara.envs.sim.latency", "SimResult": "sara.collect_async",
                               "simulate_async": "sara.collect_async", "simulate_sync": "sara.collect_async",
                               "async_vs_sync": "sara.bench.beyond"})
