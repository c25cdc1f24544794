"""THE collection loop: allocator x environment x prompt sampler, for synchronous rounds and streaming alike.

Slots free up; the allocator names the units that get them (``dispatch``, fresh prompts through ``wants_prompts``
when the open units leave slots idle); the rollouts run; results are delivered in whatever order they finish
(``finished``); units close (commit / abandon / discard) and their rollouts still running are aborted. The step ends
when the target is committed (or another stop condition), says why, and accounts every rollout started exactly once:
committed, abandoned, discarded, aborted, or carried into the next step.

``DriverConfig.barrier`` is the one switch between the two modes:

* ``barrier=True`` (synchronous rounds, the default): a round dispatches everything the allocator wants, the
  environment generates it in ONE batched call (``env.rollout``), and every result is delivered at once;
* ``barrier=False`` (streaming): at most ``slots`` single rollouts in flight on a ``StreamingEnv`` (``submit`` /
  ``poll`` / ``abort``), refilled as they finish. With ``carry_lag`` the open units and their running rollouts are
  handed to the next step (``CollectResult.carry``) instead of being discarded; with ``complete_groups`` a step that
  reaches its target waits for the groups still being filled.

Rollout ``j`` of a unit gets the seed ``(seed, step, prompt, occurrence, j)`` in both modes, so the same allocator on
the same environment commits the same groups whichever mode (and however many engines) generated them.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np
from pydantic import Field, model_validator

from sara.allocators.base import BudgetAllocator
from sara.config import MAX_STEPS, ConfigError, SaraModel, validate_config
from sara.envs.base import RolloutEnv, StreamingEnv
from sara.flight import InFlight
from sara.samplers.base import PromptSampler
from sara.step import CollectObserver, StepState, StreamCarry
from sara.types import CollectResult

__all__ = ["DispatchPolicy", "DriverConfig", "MIN_STEP_ROLLOUTS", "Rounds", "STEP_ROLLOUTS_FACTOR", "StreamCarry",
           "Streaming", "collect", "dispatch_policy", "release_carry"]

STEP_ROLLOUTS_FACTOR = 64
"""``DriverConfig.max_step_rollouts`` when it is None: this many full batches (``target_groups`` x k rollouts)..."""
MIN_STEP_ROLLOUTS = 4096
"""... and at least this many rollouts (a small batch of small groups is noisy: a few unlucky probes are no sign)."""


class DriverConfig(SaraModel):
    """How the collection loop drives an environment. Engines do not repeat these: an engine only reports its
    capacity (``StreamingEnv.slots``)."""

    barrier: bool = True
    """True: synchronous rounds (a round is dispatched whole, generated in one batched ``env.rollout`` call and
    delivered at once). False: streaming (single rollouts on a ``StreamingEnv``, refilled as they finish)."""
    slots: int | None = Field(None, ge=1, le=65_536)
    """Streaming: rollouts kept in flight at most, at most 65,536 (None = the environment's capacity,
    ``env.slots``)."""
    carry_lag: int = Field(0, ge=0, le=MAX_STEPS)
    """Streaming: hand open units and their running rollouts to the next step (``CollectResult.carry``) while their
    oldest rollout will be at most this many steps old when trained on (at most ``MAX_STEPS``); 0: abort and discard
    them at the step's end."""
    lookahead: int | None = Field(None, ge=0, le=65_536)
    """Streaming with carry-over: groups the allocator works ahead of the target, at most 65,536 (None = one more
    step's target)."""
    complete_groups: bool = False
    """Streaming: when the target is reached, wait until the groups being filled are complete (those young enough to
    be carried are carried instead) rather than committing them with fewer than k rollouts."""
    fill_idle: bool = False
    """Streaming: while groups are still needed, admit a fresh prompt into every idle slot (work-conserving) instead
    of the allocator's admission rule (more probes in flight, fewer idle slots)."""
    max_rounds: int = Field(1000, ge=1, le=MAX_STEPS)
    """Synchronous rounds: stop after this many rounds (status 'max_rounds'), at most ``MAX_STEPS``."""
    max_step_rollouts: int | None = Field(None, ge=1, le=10**12)
    """Both modes: the most rollouts one step may start, a bound against steps where nothing is effective (an
    always-wrong policy under ``ds`` or ``sara`` keeps drawing prompts); when it binds the step stops with status
    'max_step_rollouts'. None = ``STEP_ROLLOUTS_FACTOR`` x ``target_groups`` x k, at least ``MIN_STEP_ROLLOUTS``
    (64 full batches: a step reaches it only when fewer than 1 in 64 groups is effective). A smaller ``max_rollouts``
    budget binds first."""
    poll_timeout: float | None = Field(None, gt=0)
    """Streaming: seconds one ``env.poll`` may wait (None = until a rollout finishes; in-process engines ignore it)."""

    @model_validator(mode="after")
    def _streaming_only(self) -> DriverConfig:
        if self.barrier:
            for name in ("carry_lag", "complete_groups", "fill_idle", "slots", "lookahead"):
                if getattr(self, name) not in (0, False, None):
                    raise ValueError(f"field '{name}': a streaming option; set barrier=false (driver 'stream') or "
                                     f"drop it (synchronous rounds generate whole groups in batched calls)")
        return self


class DispatchPolicy(Protocol):
    """How the loop admits work: the one thing the barrier changes (``dispatch_policy`` picks it)."""

    @property
    def capacity(self) -> int:
        """Rollouts that may be in flight at once."""
        ...

    def halt(self, rounds: int, budget: int, spent: str) -> str:
        """Why the step stops before dispatching more ("" = it goes on); ``spent`` names the budget that ran out."""
        ...

    def room(self, idle: int, budget: int) -> int:
        """Slots the allocator may fill with fresh prompts, of ``idle`` free ones with ``budget`` rollouts left."""
        ...

    def cut(self, dispatched: int, budget: int) -> bool:
        """Whether dispatching ``dispatched`` rollouts spent the step's budget (then the step ends after them)."""
        ...


@dataclass(frozen=True)
class Rounds:
    """The barrier (synchronous rounds): a round is whatever the allocator dispatches, generated in one batched call;
    it admits fresh prompts regardless of the budget and is cut to it, and the step stops after ``max_rounds``."""

    max_rounds: int
    capacity: int = sys.maxsize

    def halt(self, rounds: int, budget: int, spent: str) -> str:
        return "max_rounds" if rounds >= self.max_rounds else spent if budget <= 0 else ""

    def room(self, idle: int, budget: int) -> int:
        return idle

    def cut(self, dispatched: int, budget: int) -> bool:
        return dispatched == budget


@dataclass(frozen=True)
class Streaming:
    """Streaming: at most ``capacity`` single rollouts in flight, refilled as they finish, never past the budget."""

    capacity: int

    def halt(self, rounds: int, budget: int, spent: str) -> str:
        return ""  # the loop stops when nothing is in flight and nothing more may start

    def room(self, idle: int, budget: int) -> int:
        return min(idle, budget)

    def cut(self, dispatched: int, budget: int) -> bool:
        return False


def dispatch_policy(driver: DriverConfig, env: RolloutEnv) -> DispatchPolicy:
    """``Rounds`` under the barrier, else ``Streaming`` with ``driver.slots`` or the engine's capacity.

    Raises:
        ConfigError: streaming on an environment that cannot stream.
    """
    if driver.barrier:
        return Rounds(driver.max_rounds)
    if not isinstance(env, StreamingEnv):
        raise ConfigError(f"driver: field 'barrier': {type(env).__name__} cannot stream (it needs slots, submit, poll "
                          "and abort); use synchronous rounds (barrier=true)")
    return Streaming(int(driver.slots or env.slots))


def collect(allocator: BudgetAllocator, env: RolloutEnv, sampler: PromptSampler, *, target_groups: int,
            driver: DriverConfig | Mapping[str, Any] | None = None, max_rollouts: int | None = None, seed: int = 0,
            step: int | None = None, eps: float | None = None, observers: Sequence[CollectObserver] = (),
            carry: StreamCarry | None = None, policy_version: int | None = None, hand_on: bool = True
            ) -> CollectResult:
    """Run one collection step until ``target_groups`` groups are committed (or another stop condition).

    Args:
        allocator: Decides who gets rollouts; never calls ``env`` itself.
        env: Generates and scores rollouts (``rollout`` per round; ``submit`` / ``poll`` / ``abort`` to stream).
        sampler: Supplies fresh prompt indices into ``env.prompts``.
        target_groups: Committed groups wanted (the batch size).
        driver: ``DriverConfig`` (default: synchronous rounds).
        max_rollouts: Hard budget of rollouts started in the step.
        seed: Base seed of the rollouts.
        step: Step index (default: the allocator's next step). Enters the rollout seeds.
        eps: A committed group is effective when its reward std exceeds this (default: ``allocator.eps``).
        observers: Analysis hooks told about every closed unit, e.g. ``WrongAbandons(env)``.
        carry: The previous step's ``CollectResult.carry`` (streaming, same environment): re-admitted first.
        policy_version: Weights version of the generator; stamped on delivered rollouts that carry none (a rollout
            keeps the version it was started under, so carried rollouts are marked as the older weights').
        hand_on: False: the step hands nothing on whatever ``driver.carry_lag`` (a checkpoint or the run's end follows).

    Returns:
        ``CollectResult``: committed groups (the batch), abandoned and discarded units, exact accounting (streaming:
        ``aborted_rollouts`` / ``aborted_tokens`` / ``mean_inflight``), and ``carry``. ``stats.stop_reason`` is one
        of ``target_reached``, ``max_rollouts``, ``max_step_rollouts``, ``max_rounds``, ``pool_exhausted``,
        ``allocator_done``.

    Raises:
        ConfigError: invalid options, an environment that cannot stream under ``barrier=False``, a carry under
            synchronous rounds, or ``target_groups`` larger than what the sampler can supply.
    """
    cfg = driver if isinstance(driver, DriverConfig) else validate_config(DriverConfig, dict(driver or {}),
                                                                          what="driver")
    if target_groups < 1:
        raise ConfigError(f"collect: field 'target_groups': {target_groups}; give at least 1")
    if max_rollouts is not None and max_rollouts < 1:
        raise ConfigError(f"collect: field 'max_rollouts': {max_rollouts}; give at least 1 or None")
    room = sampler.capacity()
    if room is not None and target_groups > room:
        raise ConfigError(f"collect: field 'target_groups': {target_groups} groups asked but the sampler can supply "
                          f"only {room} more prompts (sampling without replacement); lower target_groups or allow more "
                          "pool epochs")
    mode = dispatch_policy(cfg, env)
    if carry is not None and cfg.barrier:
        raise ConfigError("collect: field 'carry': only a streaming step hands units on; give carry=None")
    if (cfg.carry_lag or carry is not None) and not allocator.carries_over:
        raise ConfigError(f"driver: field 'carry_lag': {allocator.name!r} does not carry units over between steps; "
                          "give carry_lag=0")
    bound = cfg.max_step_rollouts or max(MIN_STEP_ROLLOUTS, STEP_ROLLOUTS_FACTOR * target_groups * int(allocator.k))
    limit, spent_reason = (max_rollouts, "max_rollouts") if max_rollouts is not None and max_rollouts <= bound \
        else (bound, "max_step_rollouts")
    lag = cfg.carry_lag if hand_on else 0  # how many steps a unit may be handed on from this one
    lookahead = (target_groups if cfg.lookahead is None else cfg.lookahead) if lag else 0
    st = StepState.begin(allocator, env.prompts, target_groups, step=step, seed=seed, max_rollouts=max_rollouts,
                         eps=eps, observers=observers, lookahead=lookahead)
    run = InFlight(allocator, env, st, barrier=cfg.barrier, poll_timeout=cfg.poll_timeout, version=policy_version)
    try:  # a step that fails (the engine, a stop request) leaves nothing running on the engine
        if carry is not None:
            run.take(carry)
        timer, stop = st.timer, ""
        while not stop:
            if len(st.committed) >= target_groups:
                waiting = _unfinished(allocator, st, lag) if cfg.complete_groups else ()
                if len(waiting) == 0 or not _fill(run, cast(np.ndarray, waiting), mode.capacity, limit,
                                                  keep_others=bool(lag)):
                    stop = "target_reached"
                continue
            budget = limit - run.started
            stop = mode.halt(st.rounds, budget, spent_reason)
            if stop:
                break
            idle = mode.capacity - len(run.live)
            room = mode.room(idle, budget)
            with timer("allocator"):
                ids = allocator.dispatch(min(idle, budget))
                prefixes = allocator.prefix(ids)
                m = 0
                if not st.exhausted:
                    m = (room - len(ids) if cfg.fill_idle and allocator.needed() > 0
                         else allocator.wants_prompts(room - len(ids)))
            if m > 0:
                st.admit(sampler, m)
                with timer("allocator"):
                    more = allocator.dispatch(min(idle, budget) - len(ids))
                    ids, prefixes = np.concatenate([ids, more]), prefixes + allocator.prefix(more)
            cut = mode.cut(len(ids), budget) and _wants_more(allocator)
            run.submit(ids, prefixes)
            if not run.live:
                stop = (spent_reason if run.started >= limit
                        else "pool_exhausted" if st.exhausted else "allocator_done")
                break
            run.wait()
            if cut:  # the round was cut to fit the budget: the step ends
                stop = spent_reason
    except BaseException:
        run.abort_on_failure(carry)
        raise
    handed = run.hand_on(lag) if lag else None  # before end_step closes the open units
    run.abort_units(run.units())
    with timer("allocator"):
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


def release_carry(env: StreamingEnv, carry: StreamCarry | None) -> int:
    """Abort the running rollouts of a carry that will not be used (end of a run, a checkpoint); returns the tokens
    they had generated."""
    if carry is None or not carry.live:
        return 0
    return int(env.abort(list(carry.live)))


def _wants_more(allocator: BudgetAllocator) -> bool:
    """Whether some open unit still wants rollouts beyond those in flight (a round cut by the budget)."""
    ids, want = allocator.demand()
    return bool((want > allocator.inflight(ids)).any())


def _unfinished(allocator: BudgetAllocator, st: StepState, carry_lag: int) -> np.ndarray:
    """Groups being filled the step must finish (``complete_groups``): all, or with carry-over those too old to carry."""
    ids = np.asarray(allocator.filling(), np.int64)
    return ids[st.step + 1 - st.born[ids] > carry_lag] if carry_lag else ids


def _fill(run: InFlight, waiting: np.ndarray, cap: int, limit: int, *, keep_others: bool) -> bool:
    """One round of waiting for the groups ``waiting`` (``complete_groups``): abort what else is in flight (with
    carry-over, ``keep_others``, it keeps running and dispatching), start their missing rollouts, poll. False when
    nothing is left to wait for (the budget is spent)."""
    if not keep_others:
        run.abort_units(np.setdiff1d(run.units(), waiting))
    free = min(cap - len(run.live), limit - run.started)
    with run.st.timer("allocator"):
        ids = run.allocator.dispatch(free, only=None if keep_others else waiting)
        prefixes = run.allocator.prefix(ids)
    run.submit(ids, prefixes)
    if not run.live:
        return False
    run.wait()
    return True
