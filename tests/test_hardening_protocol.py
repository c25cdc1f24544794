"""The allocator protocol checks its input at its boundary (``BudgetAllocator``'s public methods, which the driver,
verl's environment and a user's own loop all call): non-finite rewards, rewards outside the allocator's
``reward_range``, arrays of different lengths and unknown unit ids are a one-line ``ProtocolError`` naming the
rollout, and change nothing. Checked over every registered allocator through the conformance kit, which runs the
same check on any user's allocator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sara import ProtocolError, collect, make_allocator
from sara.allocators import ALLOCATORS, UniformAllocator
from sara.config import SaraError
from sara.envs.base import EnvWrapper
from sara.envs.sim.binary import SimulatedEnv
from sara.envs.sim.latency import LatencyEnv
from sara.samplers.base import UniformSampler
from sara.testing import check_allocator, check_boundary
from sara.testing.allocator import AllocatorCheckError


def _names() -> list[str]:
    names = sorted(ALLOCATORS.names())
    assert {"uniform", "ds", "sara", "sara_paper", "bayes_optimal", "sara_continuous", "sara_tree"} <= set(names)
    return names


@pytest.mark.parametrize("name", _names())
def test_every_registered_allocator_refuses_bad_input_and_is_unchanged(name):
    summary = check_boundary(lambda: make_allocator(name, k=4), AllocatorCheckError)
    assert summary["refused"] >= 20


@pytest.mark.parametrize("name", _names())
def test_a_bad_reward_names_the_rollout_and_its_range(name):
    a = make_allocator(name, k=4)
    a.begin_step(2, step=0)
    a.admit(np.array([7, 8, 9]))
    ids = a.dispatch(64)
    j = np.zeros(len(ids), np.int64)
    with pytest.raises(ProtocolError) as exc:
        a.finished(ids[:1], np.array([np.nan]), j[:1])
    msg = str(exc.value)
    assert "\n" not in msg and f"unit {ids[0]} (prompt {7 + ids[0]})" in msg and "nan" in msg and name in msg
    assert isinstance(exc.value, SaraError)  # the sara command prints it as one line
    low, high = a.reward_range
    if np.isfinite(high):
        with pytest.raises(ProtocolError, match=rf"reward {high + 1.0}.*in \[{low:g}, {high:g}\]"):
            a.finished(ids[:1], np.array([high + 1.0]), j[:1])
    assert a.units.n.sum() == 0 and a.units.inflight.sum() == len(ids)  # nothing folded in


def test_a_negative_unit_id_is_refused_not_wrapped_to_the_last_unit():
    a = UniformAllocator(k=2)
    a.begin_step(1, step=0)
    a.admit(np.array([0, 1]))
    a.dispatch(4)
    with pytest.raises(ProtocolError, match="unit_ids must be >= 0"):
        a.finished(np.array([-1, -1]), np.array([0.0, 1.0]))
    assert a.units.n.tolist() == [0, 0]


class _SkipsTheBoundary(UniformAllocator):
    """A user allocator that overrides ``finished`` without calling ``super()``: no checks."""

    name = "skips_the_boundary"

    def finished(self, unit_ids, rewards, index=None):
        unit_ids = np.asarray(unit_ids, np.int64)
        np.subtract.at(self.units.inflight, unit_ids, 1)
        return self.observe(unit_ids, np.asarray(rewards, np.float64))


def test_the_conformance_kit_catches_an_allocator_that_skips_the_boundary():
    with pytest.raises(AllocatorCheckError, match="was accepted; the protocol's boundary must refuse it"):
        check_allocator(_SkipsTheBoundary(k=4), target_groups=4, steps=1, seeds=(0,), stream=False)


class _PoisonedRewards(EnvWrapper):
    """Scores every rollout of one prompt ``bad`` (what a broken verifier or reward function would hand over)."""

    def __init__(self, env, prompt: int, bad: float) -> None:
        super().__init__(env)
        self.prompt, self.bad = prompt, bad

    def rollout(self, requests):
        out = self.env.rollout(requests)
        return [[dataclasses.replace(r, reward=self.bad) if q.pool_index == self.prompt else r for r in rs]
                for q, rs in zip(requests, out)]


@pytest.mark.parametrize("barrier", [True, False], ids=["rounds", "streaming"])
@pytest.mark.parametrize("name", ["uniform", "ds", "sara", "sara_continuous"])
def test_a_non_finite_reward_never_reaches_a_committed_group(name, barrier):
    """Through the driver, in both modes (streaming is how verl's environment delivers its rewards)."""
    base = SimulatedEnv("u-shaped", size=50, seed=0)
    env = _PoisonedRewards(base, prompt=3, bad=float("nan"))
    if not barrier:
        env = LatencyEnv(env, latency={"slots": 16})
    sampler = UniformSampler(len(base.prompts), seed=0)
    with pytest.raises(ProtocolError, match=r"\(prompt 3\) has reward nan"):
        collect(make_allocator(name, k=4), env, sampler, target_groups=40, seed=0, driver={"barrier": barrier})


def test_carry_in_refuses_a_bad_replayed_reward():
    a = make_allocator("sara", k=4)
    a.begin_step(1, step=1)
    with pytest.raises(ProtocolError, match=r"carried rollout of unit 1 \(prompt 6\) has reward inf"):
        a.carry_in(np.array([5, 6]), [np.array([1.0]), np.array([0.0, np.inf])], np.array([0, 0]))
    assert len(a.units) == 0  # nothing admitted
