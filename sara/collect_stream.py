"""The streaming driver: allocator x streaming environment, rollout by rollout, without round barriers.

``collect_stream`` keeps about ``max_inflight`` (default ``env.slots``) single rollouts in flight on a
``StreamingEnv`` (``sara.envs.base``): whenever slots are free it asks the allocator which units get the next rollouts
(``dispatch``; fresh prompts via ``wants_slots`` when it runs dry), submits them under integer tags, polls, feeds every
finished rollout to the allocator at once (``finished``), closes units, and aborts the in-flight rollouts of every
unit that closed without them. When the target is reached, everything still in flight is aborted. Aborted rollouts
are counted (``CollectStats.aborted_rollouts`` / ``aborted_tokens``) and belong to no group: rollouts started ==
delivered + aborted, and every delivered rollout is in exactly one committed / abandoned / discarded group.

**Carry-over** (``carry_lag=N``, off by default): instead of aborting and discarding at the step's end, the open units
(their delivered rollouts) and the rollouts they still have running on the engine are handed to the next step
(``CollectResult.carry``, a ``StreamCarry``; pass it back as ``carry=``), where they are re-admitted and finish. The
allocator works ``lookahead`` groups ahead (default: one more step's target), so slots that would idle while the last
groups fill probe prompts for the next step instead. Lag is bounded: a unit is carried only while its oldest rollout
will be at most ``carry_lag`` weight updates old when it is trained on; older ones are discarded as before. Rollouts
are tagged with the step they were started in (``Rollout.metadata["policy_step"]``) so a trainer can correct for their
age (``sara.train``: the generator's log-probs become the old log-probs of stale rows). Engines keep running rollouts
through a weight update (in-flight updates, as PipelineRL does): a rollout carried over mid-generation has tokens
from two weight versions, each with the log-prob its generator reported.

**Complete groups** (``complete_groups=True``, off by default): a step that reaches its target still has groups being
filled (committed, fewer than k rollouts). Without it they are committed as they are (smaller groups, the rule
``SequentialAllocator.end_step`` applies when a budget cuts a step short). With it the step waits for them: the other
in-flight rollouts are aborted (with carry-over they keep running, free slots keep probing for the next step, and
groups young enough to be carried are not waited for), nothing new is admitted, and the step ends once those groups
are complete, so every committed group has k rollouts, as in synchronous rounds.

The bookkeeping is ``collect``'s own ``StepState``, so admission and rollout seeds are identical: rollout ``j`` of a
unit gets the seed ``(seed, step, prompt, occurrence, j)`` whichever driver runs it (a carried unit takes an occurrence
in the step that re-admits it and continues ``j``).

``uniform`` and ``ds`` stream whole groups (``sara.allocators.uniform``: a group's k rollouts start together, fresh
prompts are admitted as slots free up). An allocator without the streaming API (``sara_tree``, a custom
``BudgetAllocator``) runs in synchronous rounds over the stream (plan, submit the round, poll until it is in,
observe): ``collect`` itself on a round adapter, so it commits the same groups as ``collect`` on the same environment.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from sara.allocators.base import BudgetAllocator
from sara.allocators.samplers import PromptSampler
from sara.collect import CollectObserver, StepState, collect
from sara.collect_async import StreamingAllocator
from sara.config import ConfigError
from sara.envs.base import StreamingEnv
from sara.types import CollectResult, Rollout, RolloutRequest

__all__ = ["StreamCarry", "collect_stream", "release_carry", "streams"]


def streams(obj: Any) -> bool:
    """Whether an allocator or an environment can be driven rollout by rollout (has the streaming API and does not
    opt out with ``streams = False``)."""
    proto = StreamingAllocator if isinstance(obj, BudgetAllocator) else StreamingEnv
    return isinstance(obj, proto) and bool(getattr(obj, "streams", True))


@dataclasses.dataclass(frozen=True)
class StreamCarry:
    """What a streaming step hands the next one (``collect_stream(..., carry_lag=N)``): its open units and the
    rollouts they still have running on the engine. Pass it to the next ``collect_stream`` on the same environment,
    or give its running rollouts back with ``release_carry``.

    Attributes:
        step: The step that handed it on.
        pool_index: Prompt of each carried unit ``[U]``.
        born: Step each unit was first admitted ``[U]`` (the weights of its oldest rollout).
        started: Rollouts started (seeded) per unit so far ``[U]`` (delivered + running).
        rollouts: Delivered rollouts, per unit.
        live: Engine tag of each running rollout -> ``(carried unit index, step it was started in)``.
    """

    step: int
    pool_index: np.ndarray
    born: np.ndarray
    started: np.ndarray
    rollouts: tuple[tuple[Rollout, ...], ...]
    live: dict[int, tuple[int, int]]

    @property
    def delivered(self) -> int:
        """Delivered rollouts of the carried units."""
        return sum(len(r) for r in self.rollouts)


def release_carry(env: StreamingEnv, carry: StreamCarry | None) -> int:
    """Abort the running rollouts of a carry that will not be used (end of a run, a checkpoint); returns the tokens
    they had generated."""
    if carry is None or not carry.live:
        return 0
    return int(env.abort(list(carry.live)))


def collect_stream(allocator: BudgetAllocator, env: StreamingEnv, sampler: PromptSampler, *, target_groups: int,
                   max_inflight: int | None = None, max_rollouts: int | None = None, seed: int = 0,
                   step: int | None = None, eps: float | None = None, observers: Sequence[CollectObserver] = (),
                   poll_timeout: float | None = None, carry: StreamCarry | None = None, carry_lag: int = 0,
                   lookahead: int | None = None, complete_groups: bool = False) -> CollectResult:
    """Run one collection step on a streaming environment until ``target_groups`` groups are committed.

    Args:
        allocator: Decides who gets rollouts. With the streaming API (every ``SequentialAllocator``: ``sara``,
            ``sara_async``, ``bayes_optimal``, user subclasses; ``ds``, ``uniform``) it is driven rollout by rollout;
            otherwise in rounds.
        env: A ``StreamingEnv`` (e.g. ``TaskEnv`` on a streaming backend).
        sampler: Supplies fresh prompt indices into ``env.prompts``.
        target_groups: Committed groups wanted (the batch size).
        max_inflight: Rollouts kept in flight at most (default ``env.slots``).
        max_rollouts: Hard budget of rollouts STARTED in the step (delivered + aborted).
        seed: Base seed of the rollouts (same seeds as ``collect``).
        step: Step index (default: the allocator's next step). Enters the rollout seeds.
        eps: A committed group is effective when its reward std exceeds this (default: ``allocator.eps``).
        observers: Analysis hooks told about every closed unit (as in ``collect``).
        poll_timeout: Seconds one ``env.poll`` may wait (None = until a rollout finishes; in-process engines ignore
            it). A poll that times out empty is simply repeated.
        carry: The previous step's ``CollectResult.carry`` (same environment): its units are re-admitted first.
        carry_lag: Hand open units and their running rollouts to the next step (``CollectResult.carry``) while their
            oldest rollout will be at most this many steps old when trained on; 0 (default): abort and discard them.
        lookahead: Groups the allocator works ahead of the target when carrying (default: ``target_groups``).
        complete_groups: When the target is reached, wait until the groups being filled are complete (those young
            enough to be carried are carried instead); False: commit them as they are.

    Returns:
        ``CollectResult`` as ``collect``'s, plus ``stats.aborted_rollouts`` / ``aborted_tokens`` and
        ``stats.mean_inflight`` (poll-weighted). ``stats.rounds`` counts the polls that delivered rollouts (rounds
        over the stream: the environment calls). ``stats.stop_reason``: ``target_reached``, ``max_rollouts``,
        ``pool_exhausted``, ``allocator_done``.

    Raises:
        ConfigError: ``env`` cannot stream, ``max_inflight`` < 1, ``carry_lag`` < 0, a carry for an allocator that
            cannot stream, or ``target_groups`` larger than what the sampler can supply.
    """
    if not streams(env):
        raise ConfigError(f"collect_stream: field 'env': {type(env).__name__} cannot stream (it needs slots, submit, "
                          "poll and abort on a streaming backend); use sara.collect.collect")
    cap = int(env.slots if max_inflight is None else max_inflight)
    if cap < 1:
        raise ConfigError(f"collect_stream: field 'max_inflight': {cap} rollouts in flight; give at least 1")
    if max_rollouts is not None and max_rollouts < 1:
        raise ConfigError(f"collect_stream: field 'max_rollouts': {max_rollouts}; give at least 1 or None")
    if carry_lag < 0:
        raise ConfigError(f"collect_stream: field 'carry_lag': {carry_lag}; give 0 (no carry-over) or more steps")
    if not streams(allocator):
        if carry is not None:
            raise ConfigError("collect_stream: field 'carry': only allocators with the streaming API carry units "
                              f"over; {type(allocator).__name__} runs in rounds (give carry_lag=0)")
        rounds = _RoundsOverStream(env, cap, poll_timeout)
        res = collect(allocator, rounds, sampler, target_groups=target_groups, max_rollouts=max_rollouts, seed=seed,
                      step=step, eps=eps, observers=observers)  # type: ignore[arg-type]
        return dataclasses.replace(res, stats=dataclasses.replace(res.stats, mean_inflight=rounds.mean_inflight()))
    room = sampler.capacity()
    if target_groups < 1 or (room is not None and target_groups > room):
        raise ConfigError(f"collect_stream: field 'target_groups': {target_groups} groups asked; give at least 1 and "
                          f"at most what the sampler can supply ({room} more prompts)")
    st = StepState.begin(allocator, env.prompts, target_groups, step=step, seed=seed, max_rollouts=max_rollouts,
                         eps=eps, observers=observers)
    run = _Stream(allocator, env, st, poll_timeout, tag_steps=bool(carry_lag) or carry is not None)
    if carry is not None:
        run.take(carry)
    allocator.lookahead = (target_groups if lookahead is None else int(lookahead)) if carry_lag else 0  # type: ignore[attr-defined]
    stop = ""
    while not stop:
        if len(st.committed) >= target_groups:
            waiting = _unfinished(allocator, st, carry_lag) if complete_groups else ()
            if len(waiting) == 0 or not run.fill(waiting, cap, max_rollouts, keep_others=bool(carry_lag)):
                stop = "target_reached"
                break
            continue
        free = cap - len(run.live)
        if max_rollouts is not None:
            free = min(free, max_rollouts - run.started)
        with st.timer("allocator"):
            ids = allocator.dispatch(free)  # type: ignore[attr-defined]
            m = allocator.wants_slots(free - len(ids)) if len(ids) < free and not st.exhausted else 0  # type: ignore[attr-defined]
        if m > 0:
            st.admit(sampler, m)
            with st.timer("allocator"):
                ids = np.concatenate([ids, allocator.dispatch(free - len(ids))])  # type: ignore[attr-defined]
        run.submit(np.asarray(ids, np.int64))
        if not run.live:
            budget_spent = max_rollouts is not None and run.started >= max_rollouts
            stop = "max_rollouts" if budget_spent else ("pool_exhausted" if st.exhausted else "allocator_done")
            break
        run.poll()
    handed = run.hand_on(carry_lag) if carry_lag else None  # before end_step closes the open units
    run.abort_units(np.unique(np.fromiter(run.live.values(), np.int64, count=len(run.live))))  # the step ends
    with st.timer("allocator"):
        closed = allocator.end_step()
    st.close(*closed)
    sampler.update(*allocator.observations(), st.step)
    res = st.result(stop)
    if run.started + run.carried_in != res.stats.rollouts + run.aborted + run.carried_out:
        raise AssertionError(f"accounting broken: {run.started} rollouts started + {run.carried_in} carried in, "
                             f"{res.stats.rollouts} delivered, {run.aborted} aborted, {run.carried_out} carried out")
    stats = dataclasses.replace(res.stats, aborted_rollouts=run.aborted, aborted_tokens=run.aborted_tokens,
                                mean_inflight=run.inflight_sum / run.polls if run.polls else 0.0,
                                carried_in_inflight=run.carried_in, carried_out_inflight=run.carried_out)
    return dataclasses.replace(res, stats=stats, carry=handed)


def _unfinished(allocator: Any, st: StepState, carry_lag: int) -> np.ndarray:
    """Groups being filled that the step must finish (``complete_groups``): all of them, or with carry-over those too
    old to be carried."""
    filling = getattr(allocator, "filling", None)
    if filling is None:
        raise ConfigError(f"collect_stream: field 'complete_groups': {type(allocator).__name__} does not say which "
                          "groups it is filling (no 'filling()' / 'dispatch(free, only=...)'); give complete_groups=False")
    ids = np.asarray(filling(), np.int64)
    return ids[st.step + 1 - st.born[ids] > carry_lag] if carry_lag else ids


_TAGS = itertools.count()
"""Rollout tags of every streaming step in this process (increasing; an engine may order by them)."""


class _Stream:
    """The in-flight rollouts of one streaming step: tags, submission, polling, aborts and their counts."""

    def __init__(self, allocator: Any, env: StreamingEnv, st: StepState, poll_timeout: float | None, *,
                 tag_steps: bool = False) -> None:
        self.allocator, self.env, self.st, self.poll_timeout = allocator, env, st, poll_timeout
        self.live: dict[int, int] = {}  # tag -> unit id, in submission order
        self.born: dict[int, int] = {}  # tag -> step it was started in (tag_steps: delivered as metadata)
        self.tag_steps = tag_steps
        self.started = self.aborted = self.aborted_tokens = self.polls = self.inflight_sum = 0
        self.carried_in = self.carried_out = 0

    def take(self, carry: StreamCarry) -> None:
        """Re-admit the previous step's carried units (before any fresh prompt) and adopt their running rollouts."""
        st = self.st
        st.readmit(carry.pool_index, carry.born, carry.started, carry.rollouts)
        inflight = np.bincount(np.fromiter((u for u, _ in carry.live.values()), np.int64, count=len(carry.live)),
                               minlength=len(carry.pool_index))
        rewards = [np.fromiter((r.reward for r in rs), np.float64, count=len(rs)) for rs in carry.rollouts]
        with st.timer("allocator"):
            ids, closed, decisions = self.allocator.carry_in(carry.pool_index, rewards, inflight)
        if not np.array_equal(ids, np.arange(len(carry.pool_index))):
            raise AssertionError("carry: re-admitted units must be the step's first units")
        for tag, (u, born) in carry.live.items():
            self.live[tag], self.born[tag] = int(ids[u]), born
        self.carried_in = len(carry.live)
        st.close(closed, decisions)
        self.abort_units(np.asarray(closed, np.int64))

    def hand_on(self, lag: int) -> StreamCarry | None:
        """The open units young enough for ``lag`` (and their running rollouts) leave the step for the next one."""
        st = self.st
        units = st.open_units()
        units = units[st.step + 1 - st.born[units] <= lag]
        if len(units) == 0:
            return None
        pos = {u: i for i, u in enumerate(units.tolist())}
        live = {t: (pos[u], self.born.pop(t)) for t, u in list(self.live.items()) if u in pos}
        for t in live:
            del self.live[t]
        with st.timer("allocator"):
            self.allocator.carry_out(units)
        st.hand_on(units)
        self.carried_out = len(live)
        return StreamCarry(step=st.step, pool_index=st.pool_index(units), born=st.born[units].copy(),
                           started=st.started[units].copy(), rollouts=tuple(tuple(st.rollouts_of[u]) for u in units),
                           live=live)

    def fill(self, waiting: np.ndarray, cap: int, max_rollouts: int | None, *, keep_others: bool) -> bool:
        """One round of waiting for the groups ``waiting`` (``complete_groups``): abort what else is in flight (unless
        ``keep_others``: carry-over keeps it running and dispatching), start their missing rollouts, poll. False when
        nothing is left to wait for (the budget is spent)."""
        if not keep_others:
            self.abort_units(np.setdiff1d(np.fromiter(self.live.values(), np.int64, count=len(self.live)), waiting))
        free = cap - len(self.live)
        if max_rollouts is not None:
            free = min(free, max_rollouts - self.started)
        with self.st.timer("allocator"):
            ids = self.allocator.dispatch(free, only=None if keep_others else waiting)
        self.submit(np.asarray(ids, np.int64))
        if not self.live:
            return False
        self.poll()
        return True

    def submit(self, ids: np.ndarray) -> None:
        """Start one rollout per entry of ``ids`` (seeds from ``StepState.launch``)."""
        if len(ids) == 0:
            return
        st, prompts = self.st, self.env.prompts
        seeds = st.launch(ids)
        with st.timer("allocator"):
            prefixes = self.allocator.prefix(ids)
        items = []
        for u, p, s, pre in zip(ids.tolist(), st.pool_index(ids).tolist(), seeds.tolist(), prefixes):
            tag = next(_TAGS)  # unique across steps: a late completion of an aborted tag can never match a new one
            items.append((tag, RolloutRequest(unit_id=u, pool_index=p, prompt=prompts[p], seeds=(int(s),), prefix=pre)))
            self.live[tag] = u
            if self.tag_steps:
                self.born[tag] = st.step
        self.started += len(ids)
        with st.timer("env"):
            self.env.submit(items)

    def poll(self) -> None:
        """One ``env.poll``: deliver the finished rollouts, close units, abort what closed units still have running."""
        st = self.st
        self.polls += 1
        self.inflight_sum += len(self.live)
        with st.timer("env"):
            done = self.env.poll(self.poll_timeout)
        keep: list[tuple[int, Rollout]] = []
        for tag, r in done:
            if tag in self.live:
                keep.append((tag, r))
            else:  # finished before its abort reached the engine: already counted as aborted
                self.aborted_tokens += int(r.num_tokens)
        if not keep:
            return
        unit_ids = np.fromiter((self.live.pop(tag) for tag, _ in keep), np.int64, count=len(keep))
        got = [r for _, r in keep]
        if self.tag_steps:  # the weights' age travels with the rollout (a trainer corrects stale ones)
            got = [dataclasses.replace(r, metadata={**r.metadata, "policy_step": self.born.pop(t)}) for t, r in keep]
        flat_ids, rewards = st.record(unit_ids, got)
        with st.timer("allocator"):
            closed, decisions = self.allocator.finished(flat_ids, rewards)
        st.close(closed, decisions)
        self.abort_units(np.asarray(closed, np.int64))

    def abort_units(self, units: np.ndarray) -> None:
        """Cancel every in-flight rollout of ``units`` (on the engine and in the allocator's bookkeeping)."""
        if len(units) == 0 or not self.live:
            return
        with self.st.timer("allocator"):
            busy = units[self.allocator.inflight(units) > 0]
        if len(busy) == 0:
            return
        kill = set(busy.tolist())
        tags = [t for t, u in self.live.items() if u in kill]
        for t in tags:
            del self.live[t]
            self.born.pop(t, None)
        with self.st.timer("env"):
            self.aborted_tokens += int(self.env.abort(tags))
        with self.st.timer("allocator"):
            self.allocator.abort(busy)
        self.aborted += len(tags)


class _RoundsOverStream:
    """A ``RolloutEnv`` view of a ``StreamingEnv``: one round = submit its rollouts (at most ``cap`` in flight, refilled
    as they finish) and poll until all are in, returned in seed order (``collect``'s round, on a streaming engine)."""

    def __init__(self, env: StreamingEnv, cap: int, poll_timeout: float | None) -> None:
        self.env, self.cap, self.poll_timeout = env, cap, poll_timeout
        self.prompts = env.prompts
        self.polls = self.inflight_sum = 0

    def __getattr__(self, name: str) -> Any:  # counterfactual_mixed and other analysis hooks of the env
        return getattr(self.env, name)

    def mean_inflight(self) -> float:
        return self.inflight_sum / self.polls if self.polls else 0.0

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        flat = [(i, j, dataclasses.replace(r, seeds=(s,))) for i, r in enumerate(requests) for j, s in enumerate(r.seeds)]
        out: list[list[Rollout | None]] = [[None] * r.n for r in requests]
        where: dict[int, tuple[int, int]] = {}
        nxt = 0
        while nxt < len(flat) or where:
            if nxt < len(flat) and len(where) < self.cap:
                batch = flat[nxt: nxt + self.cap - len(where)]
                self.env.submit([(nxt + t, item[2]) for t, item in enumerate(batch)])
                where.update({nxt + t: (i, j) for t, (i, j, _) in enumerate(batch)})
                nxt += len(batch)
            self.polls += 1
            self.inflight_sum += len(where)
            for tag, r in self.env.poll(self.poll_timeout):
                i, j = where.pop(tag)
                out[i][j] = r
        return out  # type: ignore[return-value]
