"""The streaming API of the sequential template: decide per finished rollout, without round barriers.

``SequentialAllocator`` (hence ``sara``, ``bayes_optimal``, ``sara_async`` and any user subclass that only overrides
``decide``) inherits this mixin. Under ``sara.collect`` (synchronous rounds) nothing here is used. A streaming driver
(``sara.collect_stream`` on a real engine, ``sara.collect_async.simulate_async`` on a simulator) instead calls:

* ``dispatch(free)``: unit ids (with repeats) for the next ``free`` generation slots: filling units first (up to
  ``k - n`` rollouts in flight), then probing units up to their in-flight limit (``probe_inflight``: the template's
  probe-schedule entry, so ``probe=1`` decides after every single rollout). Once the units committed or being filled
  cover the target, only the units the rule drains (``drain``) get their remaining rollouts (as ``plan``). Marks them
  in flight.
* ``wants_slots(idle)``: fresh prompts to admit when ``dispatch`` found no work for ``idle`` slots (the template's
  admission rule, ``wants_prompts``, capped at ``idle``; 0 once no group is needed).
* ``finished(unit_ids, rewards)``: fold finished rollouts in and decide at once (the template's ``observe``).
* ``inflight(unit_ids)``: rollouts in flight per unit (the driver aborts those of closed units).
* ``abort(unit_ids)``: forget the in-flight rollouts of units the driver cancelled.
* ``filling()``: the units being filled (committed, fewer than k rollouts), and ``dispatch(free, only=ids)``: slots
  for those units alone; what ``complete_groups`` needs.

Carry-over (``collect_stream(..., carry_lag=N)``): ``lookahead`` extra groups are treated as still needed, so the
driver keeps admitting and probing for the next step while this one finishes; at the step's end ``carry_out`` hands
the open units over (status ``CARRIED``: neither closed nor in this step's observations) and the next step re-admits
them with ``carry_in`` (their delivered rewards replayed through ``observe``, their running rollouts still in flight).

A subclass whose ``observe`` depends on ``plan`` (``sara_tree`` places leaves on tree nodes in ``plan``) sets
``streams = False``; drivers then run it in synchronous rounds.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from sara.allocators.units import UnitStatus

__all__ = ["StreamingMixin"]


class StreamingMixin:
    """Per-unit in-flight bookkeeping and the streaming calls (mixed into ``SequentialAllocator``)."""

    streams: ClassVar[bool] = True
    """Whether streaming drivers may use ``dispatch`` / ``finished`` (False: they fall back to rounds)."""

    units: Any
    k: int

    def begin_step(self, target_groups: int, step: int | None = None, max_rollouts: int | None = None) -> None:
        super().begin_step(target_groups, step, max_rollouts)  # type: ignore[misc]
        self._inflight = np.zeros(0, np.int64)
        self.lookahead = 0  # a carrying driver sets it after begin_step

    def carry_out(self, unit_ids: np.ndarray) -> None:
        """Hand open units to the next step: they are not closed by ``end_step`` and not in ``observations``."""
        unit_ids = np.asarray(unit_ids, np.int64)
        self.units.status[unit_ids] = UnitStatus.CARRIED
        self._inflight[unit_ids] = 0

    def carry_in(self, pool_index: np.ndarray, rewards: list[np.ndarray], inflight: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Re-admit units carried from the previous step: their delivered ``rewards`` (one array per unit) are
        replayed through ``observe`` (one probe, decided under this step's prior), ``inflight`` rollouts per unit are
        still running. Call before any ``admit`` of the step.

        Returns:
            ``(unit_ids, closed, decisions)``: the new unit ids, and the units the replay closed.
        """
        ids = self.admit(np.asarray(pool_index, np.int64))  # type: ignore[attr-defined]
        self._counters["units"] -= len(ids)  # type: ignore[attr-defined]  # admitted (and counted) once already
        self._inflight[ids] = np.asarray(inflight, np.int64)
        lens = np.fromiter((len(r) for r in rewards), np.int64, count=len(rewards))
        if lens.sum() == 0:
            return ids, np.zeros(0, np.int64), np.zeros(0, np.int8)
        flat = np.concatenate([np.asarray(r, np.float64) for r in rewards])
        closed, decisions = self.observe(np.repeat(ids, lens), flat)  # type: ignore[attr-defined]
        self._counters["rollouts"] -= int(lens.sum())  # type: ignore[attr-defined]  # counted when delivered
        return ids, closed, decisions

    def admit(self, pool_index: np.ndarray) -> np.ndarray:
        ids = super().admit(pool_index)  # type: ignore[misc]
        self._inflight = np.concatenate([getattr(self, "_inflight", np.zeros(0, np.int64)),
                                         np.zeros(len(ids), np.int64)])
        return ids

    def probe_inflight(self, unit_ids: np.ndarray) -> np.ndarray:
        """Rollouts a probing unit may have in flight at once (default: its probe-schedule entry)."""
        sched = np.asarray(self.config.probe, np.int64)  # type: ignore[attr-defined]
        return sched[np.minimum(self.units.probes[unit_ids], len(sched) - 1)]

    def inflight(self, unit_ids: np.ndarray) -> np.ndarray:
        """Rollouts in flight per unit."""
        return self._inflight[np.asarray(unit_ids, np.int64)]

    def wants_slots(self, idle: int) -> int:
        """Fresh prompts to admit when ``idle`` slots found no work among the open units."""
        if idle <= 0 or self._needed() == 0:  # type: ignore[attr-defined]
            return 0
        return min(idle, self.wants_prompts())  # type: ignore[attr-defined]

    def dispatch(self, free: int, only: np.ndarray | None = None) -> np.ndarray:
        """Unit ids (with repeats) for up to ``free`` rollouts to start now (among ``only`` when given); marks them in
        flight."""
        u, k = self.units, self.k
        if free <= 0 or len(u) == 0:
            return np.zeros(0, np.int64)
        fill = np.flatnonzero(u.status == UnitStatus.FILLING)
        fill_need = np.maximum(k - u.n[fill] - self._inflight[fill], 0)
        probe = np.flatnonzero(u.status == UnitStatus.PROBING)
        limit = self.probe_inflight(probe)
        if self._needed() == 0:  # type: ignore[attr-defined]
            # The groups being filled complete the target: only units the rule drains get their remaining rollouts
            # (as ``plan``); the rest is no longer probed.
            probe = probe[self._drained(probe)]  # type: ignore[attr-defined]
            limit = k - u.n[probe]
        probe_need = np.maximum(np.minimum(limit, k - u.n[probe]) - self._inflight[probe], 0)
        if only is not None:
            fill_need = np.where(np.isin(fill, only), fill_need, 0)
            probe_need = np.where(np.isin(probe, only), probe_need, 0)
        ids = np.concatenate([np.repeat(fill, fill_need), np.repeat(probe, probe_need)])[:free]
        np.add.at(self._inflight, ids, 1)
        return ids

    def finished(self, unit_ids: np.ndarray, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fold finished rollouts in (``unit_ids`` may repeat) and return the units closed now."""
        unit_ids = np.asarray(unit_ids, np.int64)
        np.subtract.at(self._inflight, unit_ids, 1)
        return self.observe(unit_ids, rewards)  # type: ignore[attr-defined]

    def abort(self, unit_ids: np.ndarray) -> None:
        """Forget the in-flight rollouts of ``unit_ids`` (the driver cancelled them)."""
        self._inflight[np.asarray(unit_ids, np.int64)] = 0

    def filling(self) -> np.ndarray:
        """Units being filled: committed, with fewer than k rollouts delivered."""
        return np.flatnonzero(self.units.status == UnitStatus.FILLING)
