"""``sara.flight.InFlight`` on its own: the rollouts of one step between dispatch and delivery (tags, birth versions,
rounds, polls, late completions of aborted rollouts, aborts of closed units, the carry between steps), on a recording
engine without a model; the loop that drives it is ``tests/test_driver_rounds.py`` / ``test_driver_stream.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sara.allocators import make_allocator
from sara.flight import TAGS, InFlight
from sara.samplers import UniformSampler
from sara.step import StepState
from sara.types import Decision, Prompt, Rollout, RolloutRequest

K = 4


class Engine:
    """Answers rollout ``seed`` with reward ``seed % 2`` and ``3`` tokens; records rounds, submissions and aborts.
    Streaming: ``poll`` delivers the oldest ``per_poll`` running rollouts; ``late`` tags are delivered even after
    their abort (a completion that raced its abort)."""

    slots = 64

    def __init__(self, n: int = 6, per_poll: int = 2) -> None:
        self.prompts = [Prompt(id=f"p{i}", prompt=f"q{i}") for i in range(n)]
        self.rounds: list[list[RolloutRequest]] = []
        self.running: dict[int, RolloutRequest] = {}
        self.aborted: list[int] = []
        self.late: dict[int, RolloutRequest] = {}
        self.versions: dict[int, int] = {}  # tag -> the version a rollout reports itself
        self.per_poll = per_poll

    def rollout(self, requests):
        self.rounds.append(list(requests))
        return [[self.make(q, s) for s in q.seeds] for q in requests]

    def submit(self, items):
        self.running.update(items)

    def poll(self, timeout=None):
        tags = sorted(self.running)[: self.per_poll]
        out = [(t, self.make(self.running.pop(t), 0, self.versions.get(t))) for t in tags]
        out += [(t, self.make(q, q.seeds[0])) for t, q in self.late.items()]
        self.late.clear()
        return out

    def abort(self, tags):
        self.aborted += list(tags)
        for t in tags:
            self.running.pop(t, None)
        return 3 * len(tags)

    @staticmethod
    def make(q: RolloutRequest, seed: int, version: int | None = None) -> Rollout:
        return Rollout(prompt_id=q.prompt.id, pool_index=q.pool_index, completion="x", reward=float(seed % 2),
                       num_tokens=3, seed=int(seed), policy_version=version)


def step(engine: Engine, *, barrier: bool, version: int | None = 7, spec: str = "uniform", step_index: int = 0,
         groups: int = 2, allocator=None):
    alloc = allocator or make_allocator(spec, k=K)
    st = StepState.begin(alloc, engine.prompts, groups, step=step_index, seed=0, lookahead=groups)
    sampler = UniformSampler(len(engine.prompts), seed=1)
    return alloc, st, sampler, InFlight(alloc, engine, st, barrier=barrier, version=version)


def dispatch(alloc, st, sampler, run, n):
    st.admit(sampler, alloc.wants_prompts(n))
    ids = alloc.dispatch(n)
    run.submit(ids, alloc.prefix(ids))
    return ids


def test_tags_are_unique_across_steps_and_increase():
    eng = Engine()
    first = step(eng, barrier=False)
    dispatch(*first, 4)
    second = step(eng, barrier=False, step_index=1)
    dispatch(*second, 4)
    a, b = list(first[3].live), list(second[3].live)
    assert a == sorted(a) and b == sorted(b) and max(a) < min(b) and not set(a) & set(b)
    assert next(TAGS) > max(b)


def test_a_round_merges_a_units_rollouts_into_one_request_and_delivers_in_dispatch_order():
    eng = Engine()
    alloc, st, sampler, run = step(eng, barrier=True)
    ids = dispatch(alloc, st, sampler, run, 2 * K)
    assert not eng.rounds and len(run.queued) == 2 * K  # queued, not generated, until the round is waited for
    run.wait()
    (round_,) = eng.rounds
    assert [q.unit_id for q in round_] == sorted(set(ids.tolist())) and all(q.n == K for q in round_)
    assert [q.index for q in round_] == [0, 0]
    assert not run.live and run.started == 2 * K
    # the seeds of the merged requests are StepState.launch's, in order: rollout j of a unit gets seed j's slot
    for q in round_:
        assert [r.seed for r in st.rollouts_of[q.unit_id]] == list(q.seeds) or st.is_closed[q.unit_id]


def test_delivered_rollouts_carry_the_version_they_started_under_unless_they_say_their_own():
    eng = Engine()
    alloc, st, sampler, run = step(eng, barrier=False, version=7)
    dispatch(alloc, st, sampler, run, 2)
    eng.versions[sorted(run.live)[0]] = 3
    run.wait()
    assert sorted(r.policy_version for rs in st.rollouts_of for r in rs) == [3, 7]
    assert not run.born  # a delivered tag's birth version is forgotten


def test_a_late_completion_of_an_aborted_rollout_is_counted_as_aborted_and_never_delivered():
    eng = Engine(per_poll=0)
    alloc, st, sampler, run = step(eng, barrier=False)
    ids = dispatch(alloc, st, sampler, run, 2 * K)
    victim = int(ids[0])
    tags = [t for t, (u, _) in run.live.items() if u == victim]
    requests = dict(eng.running)
    run.abort_units(np.array([victim]))
    assert sorted(eng.aborted) == sorted(tags) and run.aborted == len(tags) and run.aborted_tokens == 3 * len(tags)
    assert all(u != victim for u, _ in run.live.values()) and not set(tags) & set(run.born)
    eng.late = {t: requests[t] for t in tags}  # they finished before the abort reached the engine
    run.wait()
    assert st.rollouts_of[victim] == [] and run.aborted_tokens == 6 * len(tags)


def test_aborting_units_with_nothing_in_flight_calls_nobody():
    eng = Engine()
    alloc, st, sampler, run = step(eng, barrier=False)
    st.admit(sampler, 2)
    ids = alloc.dispatch(K)
    run.submit(ids, alloc.prefix(ids))
    assert set(ids.tolist()) == {0}
    run.abort_units(np.array([1], np.int64))  # admitted, nothing in flight
    run.abort_units(np.zeros(0, np.int64))
    assert eng.aborted == [] and run.aborted == 0 and len(run.live) == K


@pytest.mark.parametrize("barrier", [True, False])
def test_a_failure_aborts_whatever_runs_on_the_engine_and_only_there_when_streaming(barrier):
    eng = Engine()
    alloc, st, sampler, run = step(eng, barrier=barrier)
    dispatch(alloc, st, sampler, run, K)
    tags = sorted(run.live)
    run.abort_on_failure(None)
    assert not run.live
    assert eng.aborted == ([] if barrier else tags)


def test_hand_on_then_take_moves_open_units_and_their_running_rollouts_to_the_next_step():
    eng = Engine(per_poll=1)
    alloc = make_allocator("ds", k=K)
    _, st, sampler, run = step(eng, barrier=False, spec="ds", allocator=alloc)
    dispatch(alloc, st, sampler, run, 2 * K)
    run.wait()  # one rollout delivered: its unit stays open with K - 1 running
    running = dict(run.live)
    carry = run.hand_on(lag=1)
    assert carry is not None and not run.live and run.carried_out == len(running)
    assert sorted(carry.live) == sorted(running)
    assert sum(len(r) for r in carry.rollouts) == 1
    alloc.end_step()
    _, st2, _, run2 = step(eng, barrier=False, spec="ds", step_index=1, allocator=alloc)
    run2.take(carry)
    assert run2.carried_in == len(running) and sorted(run2.live) == sorted(running)
    assert {u for u, _ in run2.live.values()} <= set(range(len(carry.pool_index)))  # the step's first units
    assert all(run2.born[t] == 7 for t in run2.live)  # started under the previous step's weights
    eng.per_poll = len(eng.running)
    run2.wait()
    assert not run2.live and sum(len(rs) for rs in st2.rollouts_of) >= len(running)
    assert run2.started == 0  # nothing was started again: the carried rollouts ran on


def test_hand_on_with_nothing_open_hands_on_nothing():
    eng = Engine()
    alloc, st, sampler, run = step(eng, barrier=True)
    dispatch(alloc, st, sampler, run, 2 * K)
    run.wait()
    closed, decisions = alloc.end_step()
    st.close(closed, decisions)
    assert run.hand_on(lag=1) is None
    assert {g.decision for g in st.committed} <= {Decision.COMMIT}


def test_rollout_requests_are_rebuilt_from_the_step_state():
    """A queued request names its unit, prompt and seed as ``StepState.launch`` gave them."""
    eng = Engine()
    alloc, st, sampler, run = step(eng, barrier=True)
    dispatch(alloc, st, sampler, run, K)
    for tag, req in run.queued:
        u, j = run.live[tag]
        assert (req.unit_id, req.index) == (u, j) and req.prompt is eng.prompts[req.pool_index]
        assert dataclasses.replace(req, seeds=req.seeds) == req and len(req.seeds) == 1


def test_streaming_needs_an_environment_that_streams():
    class Rounds:
        prompts = Engine().prompts

        def rollout(self, requests):
            return []

    alloc = make_allocator("uniform", k=K)
    st = StepState.begin(alloc, Rounds.prompts, 1, step=0, seed=0)
    InFlight(alloc, Rounds(), st, barrier=True)
    with pytest.raises(TypeError, match="cannot stream"):
        InFlight(alloc, Rounds(), st, barrier=False)
