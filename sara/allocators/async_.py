"""Asynchronous allocation: decide per finished rollout, without round barriers (streaming engines).

``sara_async`` is SARA with per-unit in-flight bookkeeping. Under ``sara.collect`` (synchronous rounds) it behaves
exactly like ``sara`` with one rollout per probe. A streaming driver (vLLM's async engine, or the event simulator
below) instead calls:

* ``dispatch(free)``: unit ids for the next ``free`` generation slots (filling units first, then probing units with
  fewer than ``max_inflight`` rollouts in flight); ``admit`` fresh prompts when it returns fewer than ``free``;
* ``finished(unit_ids, rewards)``: fold finished rollouts in and decide at once (the template's ``observe``);
* ``inflight(unit_ids)``: rollouts in flight per unit, so the driver can abort those of closed units.

``simulate_async`` / ``simulate_sync`` compare wall-clock per effective group on a ``SimulatedEnv`` with a per-token
latency model (a rollout occupies one of ``slots`` engine slots for ``prefill_s + tokens * per_token_s`` seconds).
Synchronous rounds wait for the slowest rollout of each round (the barrier); the asynchronous driver refills a slot
the moment it frees and aborts the in-flight rollouts of a unit as soon as it is closed (their partial tokens count
as waste). Both use the same rollout seeds, so rewards and lengths are common random numbers.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from pydantic import Field

from sara.allocators.base import BudgetAllocator, Prior, UnitStatus
from sara.allocators.samplers import PromptSampler
from sara.allocators.sara import SARAAllocator, SARAConfig
from sara.config import SaraModel, validate_config
from sara.seeding import derive_seeds
from sara.types import Decision, RolloutRequest

__all__ = ["AsyncConfig", "AsyncSARAAllocator", "LatencyModel", "SimResult", "async_vs_sync", "simulate_async",
           "simulate_sync"]


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


class LatencyModel(SaraModel):
    """Per-token latency of the simulated engine."""

    slots: int = Field(256, ge=1)
    """Sequences the engine generates concurrently (continuous batching)."""
    per_token_s: float = Field(0.02, gt=0.0)
    """Seconds per generated token of one sequence (decode step time)."""
    prefill_s: float = Field(0.05, ge=0.0)
    """Seconds before the first token of a rollout (prefill + scheduling)."""

    def duration(self, tokens: np.ndarray) -> np.ndarray:
        return self.prefill_s + np.asarray(tokens, np.float64) * self.per_token_s


@dataclass
class SimResult:
    """Wall-clock accounting of one simulated step."""

    wall_s: float
    effective_groups: int
    committed_groups: int
    rollouts_finished: int
    rollouts_aborted: int
    tokens: float
    stop_reason: str

    @property
    def seconds_per_effective_group(self) -> float:
        return self.wall_s / max(self.effective_groups, 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seconds_per_effective_group": self.seconds_per_effective_group}


def _makespan(durations: np.ndarray, slots: int) -> float:
    """Time to run jobs in order on ``slots`` parallel slots (each free slot takes the next job)."""
    if len(durations) <= slots:
        return float(durations.max(initial=0.0))
    free = [0.0] * slots
    for d in durations.tolist():
        t = heapq.heappop(free)
        heapq.heappush(free, t + d)
    return max(free)


class _LatencyEnv:
    """Wraps a ``SimulatedEnv``: each ``rollout`` round advances a clock by its makespan on the engine's slots."""

    def __init__(self, env: Any, latency: LatencyModel) -> None:
        self.env, self.latency, self.clock, self.tokens = env, latency, 0.0, 0.0
        self.prompts = env.prompts

    def rollout(self, requests: list[RolloutRequest]) -> list[list[Any]]:
        out = self.env.rollout(requests)
        toks = np.fromiter((r.num_tokens for rs in out for r in rs), np.float64)
        self.clock += _makespan(self.latency.duration(toks), self.latency.slots)
        self.tokens += float(toks.sum())
        return out

    def counterfactual_mixed(self, pool_index: np.ndarray, seeds: np.ndarray, eps: float = 1e-6) -> np.ndarray:
        return self.env.counterfactual_mixed(pool_index, seeds, eps)


def simulate_sync(allocator: BudgetAllocator, env: Any, sampler: PromptSampler, *, target_groups: int,
                  latency: LatencyModel | Mapping[str, Any] | None = None, seed: int = 0,
                  step: int | None = None) -> SimResult:
    """One ``collect`` step in synchronous rounds, timed with the latency model (barrier after every round)."""
    from sara.collect import collect

    lat = latency if isinstance(latency, LatencyModel) else validate_config(LatencyModel, latency or {}, what="latency")
    wrapped = _LatencyEnv(env, lat)
    res = collect(allocator, wrapped, sampler, target_groups=target_groups, seed=seed, step=step)  # type: ignore[arg-type]
    s = res.stats
    return SimResult(wrapped.clock, s.effective_groups, s.committed_groups, s.rollouts, 0, wrapped.tokens, s.stop_reason)


def simulate_async(allocator: AsyncSARAAllocator, env: Any, sampler: PromptSampler, *, target_groups: int,
                   latency: LatencyModel | Mapping[str, Any] | None = None, seed: int = 0,
                   step: int | None = None) -> SimResult:
    """One step driven event by event: a slot is refilled as soon as it frees; closed units' rollouts are aborted.

    ``env`` must offer ``SimulatedEnv``'s vectorized ``rewards(pool, seeds)`` and ``num_tokens(rewards, seeds)``.
    Rollout ``j`` of a unit gets the same seed as under ``collect`` (``seed, step, prompt, occurrence, j``).
    """
    if not isinstance(allocator, AsyncSARAAllocator):
        raise TypeError("simulate_async needs a streaming allocator (sara_async)")
    lat = latency if isinstance(latency, LatencyModel) else validate_config(LatencyModel, latency or {}, what="latency")
    allocator.begin_step(target_groups, step)
    step_ = allocator.step
    u = allocator.units
    occurrence: list[int] = []
    seen: dict[int, int] = {}
    launched: list[int] = []  # rollouts started per unit (their index j)
    heap: list[tuple[float, int, int, float, float, float]] = []  # (finish, seq, unit, reward, tokens, start)
    clock, seq, busy = 0.0, 0, 0
    finished = aborted = 0
    tokens = 0.0
    exhausted = False
    stop = ""

    committed0 = allocator._counters["committed"]

    while True:
        if allocator._counters["committed"] - committed0 >= target_groups:
            stop = "target_reached"
            break
        free = lat.slots - busy
        ids = allocator.dispatch(free)
        if len(ids) < free and not exhausted:
            m = allocator.wants_slots(free - len(ids))
            if m > 0:
                idx = sampler.sample(m)
                exhausted = len(idx) < m
                allocator.admit(idx)
                for p in idx.tolist():
                    occurrence.append(seen.get(p, 0))
                    seen[p] = seen.get(p, 0) + 1
                    launched.append(0)
                ids = np.concatenate([ids, allocator.dispatch(free - len(ids))])
        if len(ids):
            u = allocator.units
            pool = u.pool_index[ids]
            occ = np.asarray(occurrence, np.int64)[ids]
            j = np.empty(len(ids), np.int64)
            for i, uid in enumerate(ids.tolist()):  # rollout index within its unit, in launch order
                j[i] = launched[uid]
                launched[uid] += 1
            seeds = derive_seeds(seed, step_, pool, occ, j)
            rewards = env.rewards(pool, seeds)
            toks = env.num_tokens(rewards, seeds).astype(np.float64)
            ends = clock + lat.duration(toks)
            for e, uid, r, t in zip(ends.tolist(), ids.tolist(), rewards.tolist(), toks.tolist()):
                heapq.heappush(heap, (e, seq, uid, r, t, clock))
                seq += 1
            busy += len(ids)
        if not heap:
            stop = "pool_exhausted" if exhausted else "allocator_done"
            break
        # Advance to the next completion; fold in every rollout finishing at that instant.
        clock = heap[0][0]
        done_u, done_r = [], []
        while heap and heap[0][0] <= clock:
            _, _, uid, r, t, _start = heapq.heappop(heap)
            if allocator._inflight[uid] <= 0:
                continue  # aborted earlier (its slot was freed then)
            done_u.append(uid)
            done_r.append(r)
            tokens += t
            busy -= 1
        if not done_u:
            continue
        finished += len(done_u)
        closed, dec = allocator.finished(np.asarray(done_u, np.int64), np.asarray(done_r))
        stopped = closed[dec != Decision.COMMIT]
        if len(stopped):
            busy, t_ab, n_ab = _abort(allocator, heap, stopped, clock, lat, busy)
            tokens += t_ab
            aborted += n_ab
    # Target reached (or nothing left): cancel everything still running.
    open_ = np.flatnonzero(allocator.units.status <= UnitStatus.FILLING)
    busy, t_ab, n_ab = _abort(allocator, heap, open_, clock, lat, busy)
    tokens += t_ab
    aborted += n_ab
    allocator.end_step()
    u = allocator.units
    comm = np.flatnonzero(u.status == UnitStatus.COMMITTED)
    eff = int(((u.n[comm] >= 2) & (u.std(comm) > allocator.config.eps)).sum())
    return SimResult(clock, eff, len(comm), finished, aborted, tokens, stop)


def _abort(allocator: AsyncSARAAllocator, heap: list, units: np.ndarray, clock: float, lat: LatencyModel,
           busy: int) -> tuple[int, float, int]:
    """Cancel the in-flight rollouts of ``units``; returns (busy slots, partial tokens wasted, rollouts cancelled)."""
    units = np.asarray(units, np.int64)
    if len(units) == 0:
        return busy, 0.0, 0
    n_cancel = int(allocator.inflight(units).sum())
    if n_cancel == 0:
        return busy, 0.0, 0
    kill = set(units.tolist())
    partial = sum(max(clock - start - lat.prefill_s, 0.0) / lat.per_token_s
                  for _, _, uid, _, _, start in heap if uid in kill)
    allocator.abort(units)
    return busy - n_cancel, float(partial), n_cancel


def async_vs_sync(population: str = "u-shaped", *, pool_size: int = 20_000, target_groups: int = 512, seeds: int = 2,
                  k: int = 8, latency: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Wall-clock per effective group: DS and SARA in synchronous rounds vs ``sara_async`` streaming, same pools.

    Returns ``{"rows": [{allocator, mode, seconds_per_effective_group, rollouts_per_effective_group, ...}],
    "async_vs_sync_sara": ratio, "async_vs_ds": ratio}`` (ratios of summed wall-clock over summed effective groups).
    """
    from sara.allocators import make_allocator
    from sara.allocators.samplers import UniformSampler
    from sara.envs.sim.binary import SimulatedEnv

    lat = validate_config(LatencyModel, dict(latency or {}), what="latency")
    plan = (("ds", "sync", simulate_sync), ("sara", "sync", simulate_sync), ("sara_async", "async", simulate_async))
    rows = []
    for spec, mode, fn in plan:
        res = [fn(make_allocator(spec, k=k), SimulatedEnv(population, size=pool_size, seed=s),  # type: ignore[operator]
                  UniformSampler(pool_size, seed=s), target_groups=target_groups, latency=lat, seed=s)
               for s in range(seeds)]
        eff = sum(r.effective_groups for r in res)
        rows.append({"allocator": spec, "mode": mode, "seconds_per_effective_group": sum(r.wall_s for r in res) / eff,
                     "rollouts_per_effective_group": sum(r.rollouts_finished + r.rollouts_aborted for r in res) / eff,
                     "tokens_per_effective_group": sum(r.tokens for r in res) / eff,
                     "aborted": sum(r.rollouts_aborted for r in res)})
    by = {r["allocator"]: r["seconds_per_effective_group"] for r in rows}
    return {"latency": lat.model_dump(), "rows": rows, "async_vs_sync_sara": by["sara_async"] / by["sara"],
            "async_vs_ds": by["sara_async"] / by["ds"]}
