"""``check_allocator``: conformance checks for any ``BudgetAllocator`` (run them on your own subclasses).

Checks, in both driver modes (synchronous rounds on a simulated pool; streaming on a scripted engine):
1. termination: a step ends by a real stop condition, not by hitting the round limit;
2. budget: with a rollout budget, never more rollouts than the budget;
3. accounting: every rollout the environment generated ends in exactly one committed / abandoned / discarded group
   (rollouts and tokens counted at the environment, per category recomputed from the groups' rollouts); unit ids are
   unique; group sizes are >= 1 and committed groups are not larger than ``k`` (unless ``max_group_size`` says
   otherwise);
4. determinism: two copies with the same seed produce identical groups and rewards;
5. state: ``state_dict`` -> ``load_state_dict`` into a fresh copy continues exactly like the original;
6. streaming: steps with carry-over on a scripted engine whose completions finish out of order keep exact
   accounting and are deterministic (``sara.testing.streaming``);
7. boundary: non-finite rewards, rewards outside ``reward_range``, arrays of different lengths and unknown unit ids
   are refused by every public method with a ``ProtocolError`` that changes nothing (``sara.testing.boundary``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from sara.allocators.base import BudgetAllocator
from sara.driver import collect
from sara.envs.base import RolloutEnv
from sara.envs.sim.binary import SimulatedEnv
from sara.samplers.base import UniformSampler
from sara.testing.boundary import check_boundary
from sara.testing.streaming import CountingEnv, check_streaming
from sara.types import CollectResult, Decision

__all__ = ["check_allocator", "AllocatorCheckError"]


class AllocatorCheckError(AssertionError):
    """An allocator broke one of the conformance rules; the message says which and how."""


def _fingerprint(res: CollectResult) -> list[tuple[Any, ...]]:
    return [(g.group_id, g.pool_index, int(g.decision), tuple(r.reward for r in g.rollouts), tuple(r.seed for r in g.rollouts))
            for g in (*res.groups, *res.abandoned, *res.discarded)]


def _check_accounting(res: CollectResult, allocator: BudgetAllocator, max_group_size: int | None,
                      env: CountingEnv) -> None:
    s = res.stats
    name = type(allocator).__name__
    if (s.rollouts, s.tokens) != (env.rollouts, env.tokens):
        raise AllocatorCheckError(f"{name}: stats count {s.rollouts} rollouts / {s.tokens} tokens, the environment "
                                  f"generated {env.rollouts} / {env.tokens}")
    if s.rollouts != s.committed_rollouts + s.abandoned_rollouts + s.discarded_rollouts:
        raise AllocatorCheckError(f"{name}: rollouts {s.rollouts} != committed + abandoned + discarded")
    for label, bucket, n, tok in (("committed", res.groups, s.committed_rollouts, s.committed_tokens),
                                  ("abandoned", res.abandoned, s.abandoned_rollouts, s.abandoned_tokens),
                                  ("discarded", res.discarded, s.discarded_rollouts, s.discarded_tokens)):
        got = (sum(len(g.rollouts) for g in bucket), sum(r.num_tokens for g in bucket for r in g.rollouts))
        if got != (n, tok):
            raise AllocatorCheckError(f"{name}: {label} groups hold {got[0]} rollouts / {got[1]} tokens, stats say "
                                      f"{n} / {tok}")
    groups = (*res.groups, *res.abandoned, *res.discarded)
    ids = [g.group_id for g in groups]
    if len(ids) != len(set(ids)):
        raise AllocatorCheckError(f"{name}: a unit was closed twice (duplicate group ids)")
    if sum(g.size for g in groups) != s.rollouts:
        raise AllocatorCheckError(f"{name}: groups hold {sum(g.size for g in groups)} rollouts, {s.rollouts} generated")
    for bucket, want in ((res.groups, Decision.COMMIT), (res.abandoned, Decision.ABANDON), (res.discarded, Decision.DISCARD)):
        if any(g.decision != want for g in bucket):
            raise AllocatorCheckError(f"{name}: a group in the {want.name} bucket carries another decision")
    if any(g.size < 1 for g in res.groups):
        raise AllocatorCheckError(f"{name}: committed an empty group")
    cap = max_group_size if max_group_size is not None else allocator.k
    big = [g.size for g in res.groups if g.size > cap]
    if big:
        raise AllocatorCheckError(f"{name}: committed groups larger than {cap}: sizes {big[:5]}")
    if s.effective_groups != sum(g.is_effective(allocator.eps) for g in res.groups):
        raise AllocatorCheckError(f"{name}: effective_groups does not match the committed groups")


def check_allocator(
    allocator: BudgetAllocator | Callable[[], BudgetAllocator],
    *,
    env_factory: Callable[[int], RolloutEnv] | None = None,
    target_groups: int = 48,
    steps: int = 2,
    seeds: tuple[int, ...] = (0, 1),
    max_rounds: int = 500,
    max_group_size: int | None = None,
    stream: bool = True,
) -> dict[str, Any]:
    """Run the conformance checks; raise ``AllocatorCheckError`` on the first violation.

    Args:
        allocator: An allocator (deep-copied, never mutated) or a zero-argument factory.
        env_factory: ``seed -> RolloutEnv``; default a u-shaped ``SimulatedEnv`` of 4,000 prompts (given, the streaming
            leg streams on it through a simulated engine).
        target_groups: Groups per step.
        steps: Steps per run (state carried across steps, as in training).
        seeds: Seeds to run.
        max_rounds: A step that needs more rounds than this is reported as not terminating.
        max_group_size: Largest allowed committed group (default ``allocator.k``).
        stream: Run the streaming leg too.

    Returns:
        A summary: per seed the stop reasons, rollouts and effective groups; ``stream``: the streaming leg's;
        ``boundary``: the number of bad calls refused.
    """
    if isinstance(allocator, BudgetAllocator):
        template = copy.deepcopy(allocator)

        def make() -> BudgetAllocator:
            return copy.deepcopy(template)
    else:
        make = allocator
    summary: dict[str, Any] = {"boundary": check_boundary(make, AllocatorCheckError)["refused"]}
    custom_env = env_factory  # the streaming leg streams on it too (else on its scripted engine)
    env_factory = env_factory or (lambda seed: SimulatedEnv("u-shaped", size=4000, seed=seed))
    for seed in seeds:
        runs = []
        for _ in range(2):  # twice: determinism
            alloc, env = make(), env_factory(seed)
            sampler = UniformSampler(len(env.prompts), seed=seed)
            results = []
            for t in range(steps):
                counting = CountingEnv(env)
                res = collect(alloc, counting, sampler, target_groups=target_groups, seed=seed, step=t,
                              driver={"max_rounds": max_rounds})
                if res.stats.stop_reason == "max_rounds":
                    raise AllocatorCheckError(f"{type(alloc).__name__}: step {t} did not terminate within {max_rounds} rounds")
                _check_accounting(res, alloc, max_group_size, counting)
                results.append(res)
            runs.append((alloc, sampler, results))
        a, b = ([fp for r in run[2] for fp in _fingerprint(r)] for run in runs)
        if a != b:
            raise AllocatorCheckError(f"{type(runs[0][0]).__name__}: two runs with seed {seed} differ (not deterministic)")

        # Budget: a step with a hard budget never exceeds it.
        alloc, counting = make(), CountingEnv(env_factory(seed))
        budget = max(1, target_groups * alloc.k // 3)
        res = collect(alloc, counting, UniformSampler(len(counting.prompts), seed=seed), target_groups=target_groups,
                      max_rollouts=budget, driver={"max_rounds": max_rounds}, seed=seed)
        _check_accounting(res, alloc, max_group_size, counting)
        if res.stats.rollouts > budget:
            raise AllocatorCheckError(f"{type(alloc).__name__}: {res.stats.rollouts} rollouts exceed the budget {budget}")

        # State: restore the state after step 0 into a fresh copy and replay step 1.
        results0 = runs[0][2]
        ref, env = make(), env_factory(seed)
        ref_sampler = UniformSampler(len(env.prompts), seed=seed)
        rounds = {"max_rounds": max_rounds}
        collect(ref, env, ref_sampler, target_groups=target_groups, driver=rounds, seed=seed, step=0)
        state = copy.deepcopy(ref.state_dict())
        restored = make()
        restored.load_state_dict(state)
        s_state = ref_sampler.state_dict()
        after_ref = collect(ref, env, ref_sampler, target_groups=target_groups, driver=rounds, seed=seed, step=1)
        sampler2 = UniformSampler(len(env.prompts), seed=seed)
        sampler2.load_state_dict(s_state)
        after_restored = collect(restored, env_factory(seed), sampler2, target_groups=target_groups, driver=rounds,
                                 seed=seed, step=1)
        if _fingerprint(after_ref) != _fingerprint(after_restored):
            raise AllocatorCheckError(f"{type(ref).__name__}: state_dict/load_state_dict does not restore the allocator")
        summary[f"seed{seed}"] = {
            "stop_reasons": [r.stats.stop_reason for r in results0],
            "rollouts": int(np.sum([r.stats.rollouts for r in results0])),
            "effective_groups": int(np.sum([r.stats.effective_groups for r in results0])),
        }
    if stream:
        summary["stream"] = check_streaming(make, error=AllocatorCheckError, seeds=seeds[:2],
                                            max_group_size=max_group_size, env_factory=custom_env)
    return summary
