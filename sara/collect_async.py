"""The streaming driver: one step of ``sara_async`` event by event on a simulator, timed with a latency model.

``simulate_async`` refills an engine slot the moment it frees and aborts the in-flight rollouts of a unit as soon as
it is closed (their partial tokens count as waste); ``simulate_sync`` times ``collect``'s synchronous rounds with the
same model (every round waits for its slowest rollout). Both use the same rollout seeds, so rewards and lengths are
common random numbers. The bookkeeping (admission, seeds, delivered rollouts, closed groups, ``CollectResult``) is
``collect``'s own ``StepState``; the allocator is read only through its streaming API (``dispatch``, ``finished``,
``inflight``, ``abort``, ``wants_slots``; see ``sara.allocators.async_``).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from sara.allocators.base import BudgetAllocator
from sara.allocators.samplers import PromptSampler
from sara.collect import StepState, collect
from sara.config import ConfigError, validate_config
from sara.envs.sim.latency import LatencyEnv, LatencyModel
from sara.types import CollectResult, Decision, Rollout

__all__ = ["SimResult", "StreamingAllocator", "simulate_async", "simulate_sync"]


@runtime_checkable
class StreamingAllocator(Protocol):
    """What streaming drivers need of an allocator beyond ``BudgetAllocator`` (every ``SequentialAllocator``, ``ds``
    and ``uniform`` have it, ``sara.allocators.streaming``; one that sets ``streams = False`` is run in rounds)."""

    def dispatch(self, free: int) -> np.ndarray: ...
    def finished(self, unit_ids: np.ndarray, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...
    def inflight(self, unit_ids: np.ndarray) -> np.ndarray: ...
    def abort(self, unit_ids: np.ndarray) -> None: ...
    def wants_slots(self, idle: int) -> int: ...


@dataclass
class SimResult:
    """Wall-clock accounting of one simulated step.

    Exact accounting: ``rollouts_started == result.stats.rollouts + rollouts_aborted`` and ``result.stats.rollouts ==
    committed + abandoned + discarded rollouts`` (every started rollout ends in exactly one of the four).
    """

    wall_s: float
    effective_groups: int
    committed_groups: int
    rollouts_finished: int
    rollouts_aborted: int
    tokens: float
    stop_reason: str
    rollouts_started: int = 0
    result: CollectResult | None = None

    @property
    def seconds_per_effective_group(self) -> float:
        return self.wall_s / max(self.effective_groups, 1)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "result"}
        return {**out, "seconds_per_effective_group": self.seconds_per_effective_group}


def _latency(latency: LatencyModel | Mapping[str, Any] | None) -> LatencyModel:
    return latency if isinstance(latency, LatencyModel) else validate_config(LatencyModel, latency or {},
                                                                             what="latency")


def simulate_sync(allocator: BudgetAllocator, env: Any, sampler: PromptSampler, *, target_groups: int,
                  latency: LatencyModel | Mapping[str, Any] | None = None, seed: int = 0,
                  step: int | None = None) -> SimResult:
    """One ``collect`` step in synchronous rounds, timed with the latency model (barrier after every round)."""
    wrapped = LatencyEnv(env, latency=_latency(latency))
    res = collect(allocator, wrapped, sampler, target_groups=target_groups, seed=seed, step=step)  # type: ignore[arg-type]
    s = res.stats
    return SimResult(wrapped.clock, s.effective_groups, s.committed_groups, s.rollouts, 0, wrapped.tokens,
                     s.stop_reason, rollouts_started=s.rollouts, result=res)


def simulate_async(allocator: BudgetAllocator, env: Any, sampler: PromptSampler, *, target_groups: int,
                   latency: LatencyModel | Mapping[str, Any] | None = None, seed: int = 0,
                   step: int | None = None) -> SimResult:
    """One step driven event by event: a slot is refilled as soon as it frees; closed units' rollouts are aborted.

    ``env`` must offer ``SimulatedEnv``'s vectorized ``rewards(pool, seeds)`` and ``num_tokens(rewards, seeds)``.
    Rollout ``j`` of a unit gets the same seed as under ``collect`` (``seed, step, prompt, occurrence, j``).
    """
    if not isinstance(allocator, StreamingAllocator) or not getattr(allocator, "streams", True):
        raise ConfigError(f"simulate_async: field 'allocator': {type(allocator).__name__} has no streaming API "
                          "(dispatch / finished / inflight / abort / wants_slots); use a sequential allocator such "
                          "as sara_async or sara")
    lat = _latency(latency)
    st = StepState.begin(allocator, env.prompts, target_groups, step=step, seed=seed)
    heap: list[tuple[float, int, int, float, float, float, int]] = []  # (finish, seq, unit, reward, tokens, start, seed)
    clock, seq, busy, aborted, tokens = 0.0, 0, 0, 0, 0.0
    while True:
        if len(st.committed) >= target_groups:
            stop = "target_reached"
            break
        free = lat.slots - busy
        ids = allocator.dispatch(free)
        if len(ids) < free and not st.exhausted and (m := allocator.wants_slots(free - len(ids))) > 0:
            st.admit(sampler, m)
            ids = np.concatenate([ids, allocator.dispatch(free - len(ids))])
        if len(ids):
            pool, seeds = st.pool_index(ids), st.launch(ids)
            rewards = env.rewards(pool, seeds)
            toks = env.num_tokens(rewards, seeds).astype(np.float64)
            for e, uid, r, t, s in zip((clock + lat.duration(toks)).tolist(), ids.tolist(), rewards.tolist(),
                                       toks.tolist(), seeds.tolist()):
                heapq.heappush(heap, (e, seq, uid, r, t, clock, s))
                seq += 1
            busy += len(ids)
        if not heap:
            stop = "pool_exhausted" if st.exhausted else "allocator_done"
            break
        # Advance to the next completion; fold in every rollout finishing at that instant (not aborted before).
        clock = heap[0][0]
        popped = []
        while heap and heap[0][0] <= clock:
            popped.append(heapq.heappop(heap))
        live = allocator.inflight(np.asarray([p[2] for p in popped], np.int64)) > 0
        done = [p for p, ok in zip(popped, live.tolist()) if ok]
        if not done:
            continue
        for p in done:
            tokens += p[4]
        busy -= len(done)
        done_ids = np.asarray([p[2] for p in done], np.int64)
        rollouts = [Rollout(prompt_id=env.prompts[pi].id, pool_index=pi, completion="", reward=r, num_tokens=int(t),
                            seed=s) for (_, _, _, r, t, _, s), pi in zip(done, st.pool_index(done_ids).tolist())]
        closed, dec = allocator.finished(*st.record(done_ids, rollouts))
        st.close(closed, dec)
        busy, t_ab, n_ab = _abort(allocator, heap, closed[dec != Decision.COMMIT], clock, lat, busy)
        tokens += t_ab
        aborted += n_ab
    # Target reached (or nothing left): cancel everything still running.
    busy, t_ab, n_ab = _abort(allocator, heap, st.open_units(), clock, lat, busy)
    tokens += t_ab
    aborted += n_ab
    st.close(*allocator.end_step())
    sampler.update(*allocator.observations(), st.step)
    res = st.result(stop)
    started = int(st.started.sum())
    if started != res.stats.rollouts + aborted:
        raise AssertionError(f"accounting broken: {started} rollouts started, {res.stats.rollouts} finished, "
                             f"{aborted} aborted")
    s = res.stats
    return SimResult(clock, s.effective_groups, s.committed_groups, s.rollouts, aborted, tokens, stop,
                     rollouts_started=started, result=res)


def _abort(allocator: Any, heap: list, units: np.ndarray, clock: float, lat: LatencyModel,
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
                  for _, _, uid, _, _, start, _ in heap if uid in kill)
    allocator.abort(units)
    return busy - n_cancel, float(partial), n_cancel
