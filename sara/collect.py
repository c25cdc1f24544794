"""THE driver loop: allocator x environment x prompt sampler, in synchronous batched rounds.

Each round: the allocator asks for fresh prompts (drawn from the sampler), plans how many rollouts each open unit gets,
the environment generates and scores all of them in ONE batched call, and the allocator folds the rewards in and
closes units (commit / abandon / discard). The loop always terminates and says why; every generated rollout ends in
exactly one of committed / abandoned / discarded. The per-step bookkeeping (``sara.collect_state.StepState``) is
shared with the streaming driver ``sara.collect_async``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import Field

from sara.allocators.base import BudgetAllocator
from sara.allocators.samplers import PromptSampler
from sara.config import ConfigError, SaraModel, validate_config
from sara.envs.base import RolloutEnv
from sara.seeding import derive_seeds
from sara.timing import PhaseTimer
from sara.types import CollectResult, CollectStats, Decision, Group, Prompt, Rollout, RolloutRequest

__all__ = ["collect", "CollectConfig", "CollectObserver", "StepState", "WrongAbandons", "rollout_seeds"]


class CollectConfig(SaraModel):
    """Stopping conditions and seeding of one collection step."""

    target_groups: int = Field(..., ge=1)
    """Stop once this many groups are committed (the training batch size, in groups)."""
    max_rollouts: int | None = Field(None, ge=1)
    """Hard budget of rollouts for the step (a round that would exceed it is cut to fit). None = no budget."""
    max_rounds: int = Field(1000, ge=1)
    """Stop after this many batched environment calls."""
    seed: int = 0
    """Base seed; rollout seeds derive from (seed, step, prompt, occurrence, rollout index)."""


def collect(allocator: BudgetAllocator, env: RolloutEnv, sampler: PromptSampler, *, target_groups: int,
            max_rollouts: int | None = None, max_rounds: int = 1000, seed: int = 0, step: int | None = None,
            eps: float | None = None, observers: Sequence[CollectObserver] = ()) -> CollectResult:
    """Run one collection step until ``target_groups`` groups are committed (or another stop condition).

    Args:
        allocator: Decides who gets rollouts; never calls ``env`` itself.
        env: Generates and scores one round of requests per call.
        sampler: Supplies fresh prompt indices into ``env.prompts``.
        target_groups: Committed groups wanted (the batch size).
        max_rollouts: Optional hard rollout budget for the step.
        max_rounds: Maximum batched environment calls.
        seed: Base seed of the rollouts.
        step: Step index (default: the allocator's next step). Enters the rollout seeds.
        eps: A committed group is effective when its reward std exceeds this (default: ``allocator.eps``).
        observers: Analysis hooks told about every closed unit, e.g. ``WrongAbandons(env)`` (fills
            ``stats.wrong_abandons`` on a simulator).

    Returns:
        ``CollectResult`` with committed groups (the batch), abandoned and discarded units, and exact accounting.
        ``stats.stop_reason`` is one of ``target_reached``, ``max_rollouts``, ``max_rounds``, ``pool_exhausted``,
        ``allocator_done``.

    Raises:
        ConfigError: invalid stopping conditions, e.g. ``target_groups`` larger than what the sampler can supply.
    """
    cfg = validate_config(CollectConfig, dict(target_groups=target_groups, max_rollouts=max_rollouts,
                                              max_rounds=max_rounds, seed=seed), what="collect")
    cap = sampler.capacity()
    if cap is not None and cfg.target_groups > cap:
        raise ConfigError(f"collect: field 'target_groups': {cfg.target_groups} groups asked but the sampler can supply "
                          f"only {cap} more prompts (sampling without replacement); lower target_groups or allow more epochs")
    st = StepState.begin(allocator, env.prompts, cfg.target_groups, step=step, seed=cfg.seed,
                         max_rollouts=cfg.max_rollouts, eps=eps, observers=observers)
    timer = st.timer  # "allocator": time inside the allocator's methods; "env": inside env.rollout
    while not (stop := _stop_before_round(st, cfg)):
        with timer("allocator"):
            m = allocator.wants_prompts()
        st.admit(sampler, m)
        with timer("allocator"):
            ids, counts = allocator.plan()
        if len(ids) == 0:
            stop = "pool_exhausted" if st.exhausted else "allocator_done"
            break
        budget_left = None if cfg.max_rollouts is None else cfg.max_rollouts - st.rollouts
        cut = budget_left is not None and counts.sum() > budget_left
        if cut:  # cut the round to fit the budget, in plan order
            counts = np.minimum(counts, np.maximum(budget_left - (np.cumsum(counts) - counts), 0))
            ids, counts = ids[counts > 0], counts[counts > 0]
        requests = [RolloutRequest(unit_id=u, pool_index=p, prompt=env.prompts[p], seeds=s, prefix=pre)
                    for u, p, s, pre in zip(ids.tolist(), st.pool_index(ids).tolist(), st.launch_groups(ids, counts),
                                            allocator.prefix(ids))]
        with timer("env"):
            results = env.rollout(requests)
        if len(results) != len(requests) or any(len(r) != q.n for r, q in zip(results, requests)):
            raise RuntimeError(f"{type(env).__name__}.rollout returned a wrong number of rollouts for the round")
        flat_ids, flat_r = st.record(np.repeat(ids, counts), [r for rs in results for r in rs])
        with timer("allocator"):
            closed = allocator.observe(flat_ids, flat_r)
        st.close(*closed)
        if cut:
            stop = "max_rollouts"
            break
    with timer("allocator"):
        closed = allocator.end_step()
    st.close(*closed)
    sampler.update(*allocator.observations(), st.step)
    return st.result(stop)


def _stop_before_round(st: StepState, cfg: CollectConfig) -> str:
    if len(st.committed) >= cfg.target_groups:
        return "target_reached"
    if st.rounds >= cfg.max_rounds:
        return "max_rounds"
    if cfg.max_rollouts is not None and st.rollouts >= cfg.max_rollouts:
        return "max_rollouts"
    return ""


def rollout_seeds(seed: int, step: int, pool_index: np.ndarray, occurrence: np.ndarray, start: np.ndarray,
                  counts: np.ndarray) -> list[tuple[int, ...]]:
    """Seeds of rollouts ``start .. start+count-1`` of each unit (vectorized; one tuple per unit)."""
    unit = np.repeat(np.arange(len(counts)), counts)
    j = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(start, counts)
    flat = derive_seeds(seed, step, pool_index[unit], occurrence[unit], j)
    return [tuple(int(x) for x in part) for part in np.split(flat, np.cumsum(counts)[:-1])]


class CollectObserver:
    """An analysis hook of a driver: told about every closed unit; may add fields to the step's ``CollectStats``."""

    def begin(self, state: StepState) -> None:
        """A step starts (reset per-step counts here)."""

    def closed(self, state: StepState, unit_ids: np.ndarray, decisions: np.ndarray) -> None:
        """Units were closed with ``decisions`` (their groups are already in ``state``)."""

    def stats(self) -> dict[str, Any]:
        """``CollectStats`` fields this observer fills in."""
        return {}


class WrongAbandons(CollectObserver):
    """Counts abandoned units whose full size-k group would have been mixed (``stats.wrong_abandons``).

    Needs an environment that can tell, for analysis only: ``env.counterfactual_mixed(pool_index, seeds [m, k], eps)``
    (the simulators; a Ray pool forwards it). The full group's rollouts get the seeds ``collect`` would have used.
    """

    def __init__(self, env: Any) -> None:
        if not hasattr(env, "counterfactual_mixed"):
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
    """Bookkeeping of one collection step, shared by ``collect`` and ``sara.collect_async``.

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
        self.exhausted = False
        self._seen: dict[int, int] = defaultdict(int)
        self.timer = timer or PhaseTimer()  # drivers time the allocator ("allocator") and the environment ("env")
        self._decisions0 = allocator.metrics().get("alloc/decisions", 0.0)
        for obs in self.observers:
            obs.begin(self)

    @classmethod
    def begin(cls, allocator: BudgetAllocator, prompts: Sequence[Prompt], target_groups: int, *, step: int | None,
              seed: int, max_rollouts: int | None = None, eps: float | None = None,
              observers: Sequence[CollectObserver] = ()) -> StepState:
        """Start the allocator's step and return its bookkeeping."""
        timer = PhaseTimer()
        with timer("allocator"):
            allocator.begin_step(target_groups, step, max_rollouts=max_rollouts)
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

    def launch(self, unit_ids: np.ndarray) -> np.ndarray:
        """Seeds of one new rollout per entry of ``unit_ids`` (repeats allowed; rollout j of a unit gets the seed
        ``(seed, step, prompt, occurrence, j)`` in launch order, whatever the driver)."""
        unit_ids = np.asarray(unit_ids, np.int64)
        order = np.argsort(unit_ids, kind="stable")
        rank = np.empty(len(unit_ids), np.int64)
        rank[order] = np.arange(len(unit_ids)) - np.searchsorted(unit_ids[order], unit_ids[order], side="left")
        j = self.started[unit_ids] + rank
        np.add.at(self.started, unit_ids, 1)
        return derive_seeds(self.seed, self.step, self.pool_index(unit_ids), self.occurrence[unit_ids], j)

    def launch_groups(self, unit_ids: np.ndarray, counts: np.ndarray) -> list[tuple[int, ...]]:
        """``launch`` for ``counts[i]`` rollouts of each of the distinct ``unit_ids``, as one seed tuple per unit."""
        seeds = rollout_seeds(self.seed, self.step, self.pool_index(unit_ids), self.occurrence[unit_ids],
                              self.started[unit_ids], counts)
        self.started[unit_ids] += counts
        return seeds

    def record(self, unit_ids: np.ndarray, rollouts: Sequence[Rollout]) -> tuple[np.ndarray, np.ndarray]:
        """Delivered rollouts (flat, one unit id each) of one environment call; returns ``(unit_ids, rewards)``."""
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
        sums = {name: (sum(g.size for g in gs), sum(g.num_tokens for g in gs))
                for name, gs in (("c", self.committed), ("a", self.abandoned), ("d", self.discarded))}
        extra: dict[str, Any] = {}
        for obs in self.observers:
            extra.update(obs.stats())
        stats = CollectStats(
            rollouts=self.rollouts, rounds=self.rounds,
            tokens=sum(v[1] for v in sums.values()) + self.carried_out_tokens - self.carried_in_tokens,
            committed_groups=len(self.committed), effective_groups=len(eff), abandoned_groups=len(self.abandoned),
            discarded_groups=len(self.discarded), committed_rollouts=sums["c"][0], abandoned_rollouts=sums["a"][0],
            discarded_rollouts=sums["d"][0], committed_tokens=sums["c"][1], abandoned_tokens=sums["a"][1],
            discarded_tokens=sums["d"][1], prompts_drawn=self.drawn, stop_reason=stop,
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
