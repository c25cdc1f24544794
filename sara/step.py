"""The bookkeeping of one collection step (``StepState``), analysis observers, and what a step hands the next.

``sara.driver.collect`` owns the loop; ``StepState`` owns, per unit, the prompt's occurrence in the step (it enters
the rollout seeds), the rollouts started and delivered, and whether the unit is closed; the closed groups by decision;
the counters; and the exact accounting check behind ``CollectResult``. ``StreamCarry`` is what a streaming step with
carry-over hands the next one.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from sara.allocators.base import BudgetAllocator
from sara.config import ConfigError
from sara.samplers.base import PromptSampler
from sara.seeding import derive_seeds
from sara.timing import PhaseTimer
from sara.types import CollectResult, CollectStats, Decision, Group, Prompt, Rollout

__all__ = ["CollectObserver", "Counterfactual", "StepState", "StreamCarry", "WrongAbandons"]


class CollectObserver:
    """An analysis hook of a driver: told about every closed unit; may add fields to the step's ``CollectStats``."""

    def begin(self, state: StepState) -> None:
        """A step starts (reset per-step counts here)."""

    def closed(self, state: StepState, unit_ids: np.ndarray, decisions: np.ndarray) -> None:
        """Units were closed with ``decisions`` (their groups are already in ``state``)."""

    def collected(self, state: StepState) -> None:
        """The step's collection ended (its groups are all in ``state``; ``stats`` is read next)."""

    def stats(self) -> dict[str, Any]:
        """``CollectStats`` fields this observer fills in."""
        return {}


@runtime_checkable
class Counterfactual(Protocol):
    """An environment that can tell what a group would have been (the simulators; a Ray pool of them forwards it)."""

    def counterfactual_mixed(self, pool_index: np.ndarray, seeds: np.ndarray, eps: float = 1e-6) -> np.ndarray:
        """Per row of ``seeds [m, k]``: would the full size-k group of ``pool_index[i]`` have been effective?"""
        ...


class WrongAbandons(CollectObserver):
    """Counts abandoned units whose full size-k group would have been mixed (``stats.wrong_abandons``).

    Needs a ``Counterfactual`` environment (for analysis only: the simulators). The full group's rollouts get the
    seeds the driver would have used.
    """

    def __init__(self, env: object) -> None:
        if not isinstance(env, Counterfactual):
            raise ConfigError(f"WrongAbandons: field 'env': {type(env).__name__} has no counterfactual_mixed "
                              "(only simulators can tell what an abandoned group would have been)")
        self.env = env
        self.count = 0

    def begin(self, state: StepState) -> None:
        self.count = 0

    def closed(self, state: StepState, unit_ids: np.ndarray, decisions: np.ndarray) -> None:
        ab = unit_ids[decisions == Decision.ABANDON]
        if len(ab):
            pool, occ = state.pool_index(ab), state.occurrence[ab]
            seeds = derive_seeds(state.seed, state.step, pool[:, None], occ[:, None], np.arange(state.k)[None, :])
            self.count += int(self.env.counterfactual_mixed(pool, seeds, state.eps).sum())

    def stats(self) -> dict[str, Any]:
        return {"wrong_abandons": self.count}


class StepState:
    """Bookkeeping of one collection step of ``sara.driver.collect``.

    Per unit (unit ids are admission order): the prompt's occurrence in the step (it enters the rollout seeds), the
    rollouts started (seeded) and delivered, and whether it is closed; the closed groups by decision; counters. Pool
    indices are the allocator's (``allocator.pool_indices``). ``result`` builds the ``CollectResult`` and checks the
    accounting. Create it with ``begin`` (which starts the allocator's step).
    """

    def __init__(self, allocator: BudgetAllocator, prompts: Sequence[Prompt], *, seed: int, eps: float | None = None,
                 observers: Sequence[CollectObserver] = (), timer: PhaseTimer | None = None) -> None:
        self.allocator, self.prompts, self.seed = allocator, prompts, int(seed)
        self.step, self.k, self.target_groups = allocator.step, allocator.k, allocator.target_groups
        self.eps = allocator.eps if eps is None else float(eps)
        self.observers = tuple(observers)
        self.occurrence = np.zeros(0, np.int64)
        self.started = np.zeros(0, np.int64)
        self.is_closed = np.zeros(0, bool)
        self.rollouts_of: list[list[Rollout]] = []
        self.committed: list[Group] = []
        self.abandoned: list[Group] = []
        self.discarded: list[Group] = []
        self.rollouts = self.rounds = self.drawn = 0
        self.born = np.zeros(0, np.int64)  # step each unit was first admitted (earlier for carried units)
        self.carried_in = self.carried_out = 0  # delivered rollouts of carried units, received / handed on
        self.carried_in_tokens = self.carried_out_tokens = 0
        self.carried_in_prompt_tokens = self.carried_out_prompt_tokens = 0
        self.exhausted = False
        self._seen: dict[int, int] = defaultdict(int)
        self.timer = timer or PhaseTimer()  # drivers time the allocator ("allocator") and the environment ("env")
        self._decisions0 = allocator.metrics().get("alloc/decisions", 0.0)
        for obs in self.observers:
            obs.begin(self)

    @classmethod
    def begin(cls, allocator: BudgetAllocator, prompts: Sequence[Prompt], target_groups: int, *, step: int | None,
              seed: int, max_rollouts: int | None = None, eps: float | None = None,
              observers: Sequence[CollectObserver] = (), lookahead: int = 0) -> StepState:
        """Start the allocator's step and return its bookkeeping."""
        timer = PhaseTimer()
        with timer("allocator"):
            allocator.begin_step(target_groups, step=step, max_rollouts=max_rollouts, lookahead=lookahead)
        return cls(allocator, prompts, seed=seed, eps=eps, observers=observers, timer=timer)

    def pool_index(self, unit_ids: np.ndarray) -> np.ndarray:
        return self.allocator.pool_indices(unit_ids)

    def admit(self, sampler: PromptSampler, m: int) -> np.ndarray:
        """Draw up to ``m`` fresh prompts and admit them to the allocator (nothing once the sampler ran dry)."""
        if m <= 0 or self.exhausted:
            return np.zeros(0, np.int64)
        idx = sampler.sample(m)
        self.exhausted = len(idx) < m
        self.drawn += len(idx)
        with self.timer("allocator"):
            ids = self.allocator.admit(idx)
        occ = np.empty(len(idx), np.int64)
        for i, p in enumerate(idx.tolist()):
            occ[i] = self._seen[p]
            self._seen[p] += 1
        self._append(occ, np.zeros(len(idx), np.int64), np.full(len(idx), self.step, np.int64), [[] for _ in idx])
        return ids

    def readmit(self, pool_index: np.ndarray, born: np.ndarray, started: np.ndarray,
                rollouts: Sequence[Sequence[Rollout]]) -> None:
        """Units carried in from the previous step (a streaming driver's carry-over), before any ``admit``: each takes
        a fresh occurrence of its prompt in this step (its further rollouts are seeded ``(seed, step, prompt,
        occurrence, j)`` with ``j`` continuing after ``started``) and keeps its delivered ``rollouts``. The allocator's
        side is ``carry_in``."""
        occ = np.empty(len(pool_index), np.int64)
        for i, p in enumerate(np.asarray(pool_index, np.int64).tolist()):
            occ[i] = self._seen[p]
            self._seen[p] += 1
        self.carried_in += sum(len(r) for r in rollouts)
        self.carried_in_tokens += sum(x.num_tokens for r in rollouts for x in r)
        self.carried_in_prompt_tokens += sum(x.prompt_tokens for r in rollouts for x in r)
        self._append(occ, np.asarray(started, np.int64), np.asarray(born, np.int64), [list(r) for r in rollouts])

    def _append(self, occ: np.ndarray, started: np.ndarray, born: np.ndarray, rollouts: list[list[Rollout]]) -> None:
        self.occurrence = np.concatenate([self.occurrence, occ])
        self.started = np.concatenate([self.started, started])
        self.born = np.concatenate([self.born, born])
        self.is_closed = np.concatenate([self.is_closed, np.zeros(len(occ), bool)])
        self.rollouts_of.extend(rollouts)

    def hand_on(self, unit_ids: np.ndarray) -> None:
        """Open units carried into the next step: they leave this step without a group."""
        unit_ids = np.asarray(unit_ids, np.int64)
        self.is_closed[unit_ids] = True
        self.carried_out += sum(len(self.rollouts_of[u]) for u in unit_ids.tolist())
        self.carried_out_tokens += sum(x.num_tokens for u in unit_ids.tolist() for x in self.rollouts_of[u])
        self.carried_out_prompt_tokens += sum(x.prompt_tokens for u in unit_ids.tolist() for x in self.rollouts_of[u])

    def launch(self, unit_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(seeds, j)`` of one new rollout per entry of ``unit_ids`` (repeats allowed): rollout ``j`` of a unit (its
        index within the unit, in launch order) gets the seed ``(seed, step, prompt, occurrence, j)``, whatever the
        driver mode or the engine's sharding."""
        unit_ids = np.asarray(unit_ids, np.int64)
        order = np.argsort(unit_ids, kind="stable")
        rank = np.empty(len(unit_ids), np.int64)
        rank[order] = np.arange(len(unit_ids)) - np.searchsorted(unit_ids[order], unit_ids[order], side="left")
        j = self.started[unit_ids] + rank
        np.add.at(self.started, unit_ids, 1)
        return derive_seeds(self.seed, self.step, self.pool_index(unit_ids), self.occurrence[unit_ids], j), j

    def record(self, unit_ids: np.ndarray, rollouts: Sequence[Rollout]) -> tuple[np.ndarray, np.ndarray]:
        """Delivered rollouts (flat, one unit id each) of one environment call (a round, or a poll); returns
        ``(unit_ids, rewards)``."""
        for u, r in zip(unit_ids.tolist(), rollouts):
            self.rollouts_of[u].append(r)
        self.rounds += 1
        self.rollouts += len(rollouts)
        return unit_ids, np.fromiter((r.reward for r in rollouts), np.float64, count=len(rollouts))

    def open_units(self) -> np.ndarray:
        return np.flatnonzero(~self.is_closed)

    def close(self, unit_ids: np.ndarray, decisions: np.ndarray) -> None:
        """Units closed by the allocator: their groups go to the committed / abandoned / discarded lists."""
        unit_ids, decisions = np.asarray(unit_ids, np.int64), np.asarray(decisions, np.int8)
        self.is_closed[unit_ids] = True
        buckets = {Decision.COMMIT: self.committed, Decision.ABANDON: self.abandoned}
        for u, p, d in zip(unit_ids.tolist(), self.pool_index(unit_ids).tolist(), decisions.tolist()):
            g = Group(group_id=u, prompt=self.prompts[p], pool_index=p, rollouts=tuple(self.rollouts_of[u]),
                      decision=Decision(d))
            buckets.get(d, self.discarded).append(g)
        for obs in self.observers:
            obs.closed(self, unit_ids, decisions)

    def result(self, stop: str) -> CollectResult:
        """The step's ``CollectResult``; raises if a rollout was lost or counted twice."""
        eff = [g for g in self.committed if g.is_effective(self.eps)]
        sums = {name: (sum(g.size for g in gs), sum(g.num_tokens for g in gs), sum(g.prompt_tokens for g in gs))
                for name, gs in (("c", self.committed), ("a", self.abandoned), ("d", self.discarded))}
        extra: dict[str, Any] = {}
        for obs in self.observers:
            obs.collected(self)
            extra.update(obs.stats())
        stats = CollectStats(
            rollouts=self.rollouts, rounds=self.rounds,
            tokens=sum(v[1] for v in sums.values()) + self.carried_out_tokens - self.carried_in_tokens,
            committed_groups=len(self.committed), effective_groups=len(eff), abandoned_groups=len(self.abandoned),
            discarded_groups=len(self.discarded), committed_rollouts=sums["c"][0], abandoned_rollouts=sums["a"][0],
            discarded_rollouts=sums["d"][0], committed_tokens=sums["c"][1], abandoned_tokens=sums["a"][1],
            discarded_tokens=sums["d"][1],
            prompt_tokens=sum(v[2] for v in sums.values()) + self.carried_out_prompt_tokens
            - self.carried_in_prompt_tokens, prompts_drawn=self.drawn, stop_reason=stop,
            target_groups=self.target_groups, allocator_seconds=self.timer.seconds["allocator"],
            env_seconds=self.timer.seconds["env"],
            decisions=int(self.allocator.metrics().get("alloc/decisions", 0.0) - self._decisions0),
            effective_rollouts=sum(g.size for g in eff), carried_in_rollouts=self.carried_in,
            carried_out_rollouts=self.carried_out, **extra,
        )
        grouped = stats.committed_rollouts + stats.abandoned_rollouts + stats.discarded_rollouts
        if stats.rollouts + self.carried_in != grouped + self.carried_out:
            raise AssertionError(f"accounting broken: {stats}")  # an allocator lost or duplicated a unit
        return CollectResult(groups=tuple(self.committed), abandoned=tuple(self.abandoned),
                             discarded=tuple(self.discarded), stats=stats)


@dataclasses.dataclass(frozen=True)
class StreamCarry:
    """What a streaming step hands the next one (``DriverConfig.carry_lag``): its open units and the rollouts they
    still have running on the engine. Pass it as ``carry=`` to the next ``collect`` on the same environment, or give
    its running rollouts back with ``sara.driver.release_carry``.

    Attributes:
        step: The step that handed it on.
        pool_index: Prompt of each carried unit ``[U]``.
        born: Step each unit was first admitted ``[U]`` (the weights of its oldest rollout).
        started: Rollouts started (seeded) per unit so far ``[U]`` (delivered + running).
        rollouts: Delivered rollouts, per unit.
        live: Engine tag of each running rollout -> ``(carried unit index, its index j in the unit, the policy version
            it was started under or None)``.
    """

    step: int
    pool_index: np.ndarray
    born: np.ndarray
    started: np.ndarray
    rollouts: tuple[tuple[Rollout, ...], ...]
    live: dict[int, tuple[int, int, int | None]]

    @property
    def delivered(self) -> int:
        """Delivered rollouts of the carried units."""
        return sum(len(r) for r in self.rollouts)
