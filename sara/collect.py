"""THE driver loop: allocator x environment x prompt sampler, in synchronous batched rounds.

Each round: the allocator asks for fresh prompts (drawn from the sampler), plans how many rollouts each open unit gets,
the environment generates and scores all of them in ONE batched call, and the allocator folds the rewards in and
closes units (commit / abandon / discard). The loop always terminates and says why; every generated rollout ends in
exactly one of committed / abandoned / discarded.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
from pydantic import Field

from sara.allocators.base import BudgetAllocator
from sara.allocators.samplers import PromptSampler
from sara.config import ConfigError, SaraModel, validate_config
from sara.envs.base import RolloutEnv
from sara.seeding import derive_seeds
from sara.types import CollectResult, CollectStats, Decision, Group, Rollout, RolloutRequest

__all__ = ["collect", "CollectConfig", "rollout_seeds"]


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


def rollout_seeds(seed: int, step: int, pool_index: np.ndarray, occurrence: np.ndarray, start: np.ndarray,
                  counts: np.ndarray) -> list[tuple[int, ...]]:
    """Seeds of rollouts ``start .. start+count-1`` of each unit (vectorized; one tuple per unit)."""
    total = int(counts.sum())
    unit = np.repeat(np.arange(len(counts)), counts)
    j = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(start, counts)
    flat = derive_seeds(seed, step, pool_index[unit], occurrence[unit], j)
    bounds = np.cumsum(counts)[:-1]
    return [tuple(int(x) for x in part) for part in np.split(flat, bounds)]


def collect(allocator: BudgetAllocator, env: RolloutEnv, sampler: PromptSampler, *, target_groups: int,
            max_rollouts: int | None = None, max_rounds: int = 1000, seed: int = 0, step: int | None = None,
            on_round: Callable[[dict[str, Any]], None] | None = None) -> CollectResult:
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
        on_round: Optional callback with a small dict of live numbers after each round (progress bars).

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
    timer = _Timer()
    decisions_before = allocator.metrics().get("alloc/decisions", 0.0)
    with timer("allocator"):
        allocator.begin_step(cfg.target_groups, step, max_rollouts=cfg.max_rollouts)
    step_ = allocator.step
    k = allocator.k

    rollouts: list[list[Rollout]] = []  # per unit id
    pool_of: list[int] = []
    occurrence: list[int] = []
    seen: dict[int, int] = defaultdict(int)
    committed: list[Group] = []
    abandoned: list[Group] = []
    discarded: list[Group] = []
    n_rollouts = rounds = drawn = 0
    wrong = 0
    exhausted = False
    can_tell = hasattr(env, "counterfactual_mixed")

    def close(ids: np.ndarray, decisions: np.ndarray) -> None:
        nonlocal wrong
        for u, d in zip(ids.tolist(), decisions.tolist()):
            g = Group(group_id=u, prompt=env.prompts[pool_of[u]], pool_index=pool_of[u], rollouts=tuple(rollouts[u]),
                      decision=Decision(d))
            (committed if d == Decision.COMMIT else abandoned if d == Decision.ABANDON else discarded).append(g)
        ab = ids[decisions == Decision.ABANDON]
        if can_tell and len(ab):
            pool = np.asarray([pool_of[u] for u in ab.tolist()], np.int64)
            occ = np.asarray([occurrence[u] for u in ab.tolist()], np.int64)
            seeds = derive_seeds(cfg.seed, step_, pool[:, None], occ[:, None], np.arange(k)[None, :])
            wrong += int(env.counterfactual_mixed(pool, seeds, allocator.config.eps).sum())  # type: ignore[attr-defined]

    stop = ""
    while True:
        if len(committed) >= cfg.target_groups:
            stop = "target_reached"
            break
        if rounds >= cfg.max_rounds:
            stop = "max_rounds"
            break
        budget_left = None if cfg.max_rollouts is None else cfg.max_rollouts - n_rollouts
        if budget_left is not None and budget_left <= 0:
            stop = "max_rollouts"
            break
        with timer("allocator"):
            m = allocator.wants_prompts()
        if m > 0 and not exhausted:
            idx = sampler.sample(m)
            exhausted = len(idx) < m
            drawn += len(idx)
            with timer("allocator"):
                allocator.admit(idx)
            for p in idx.tolist():
                pool_of.append(p)
                occurrence.append(seen[p])
                seen[p] += 1
                rollouts.append([])
        with timer("allocator"):
            ids, counts = allocator.plan()
        if len(ids) == 0:
            stop = "pool_exhausted" if exhausted else "allocator_done"
            break
        cut = False
        if budget_left is not None and counts.sum() > budget_left:  # cut the round to fit the budget, in plan order
            counts = np.minimum(counts, np.maximum(budget_left - (np.cumsum(counts) - counts), 0))
            ids, counts, cut = ids[counts > 0], counts[counts > 0], True
        pool = np.asarray([pool_of[u] for u in ids.tolist()], np.int64)
        occ = np.asarray([occurrence[u] for u in ids.tolist()], np.int64)
        start = np.asarray([len(rollouts[u]) for u in ids.tolist()], np.int64)
        seeds = rollout_seeds(cfg.seed, step_, pool, occ, start, counts)
        prefixes = allocator.prefix(ids)
        requests = [RolloutRequest(unit_id=u, pool_index=p, prompt=env.prompts[p], seeds=s, prefix=pre)
                    for u, p, s, pre in zip(ids.tolist(), pool.tolist(), seeds, prefixes)]
        with timer("env"):
            results = env.rollout(requests)
        if len(results) != len(requests) or any(len(r) != q.n for r, q in zip(results, requests)):
            raise RuntimeError(f"{type(env).__name__}.rollout returned a wrong number of rollouts for the round")
        for u, rs in zip(ids.tolist(), results):
            rollouts[u].extend(rs)
        rounds += 1
        n_rollouts += int(counts.sum())
        flat_ids = np.repeat(ids, counts)
        flat_r = np.fromiter((r.reward for rs in results for r in rs), np.float64, count=int(counts.sum()))
        with timer("allocator"):
            closed_ids, decisions = allocator.observe(flat_ids, flat_r)
        close(closed_ids, decisions)
        if on_round is not None:
            on_round({"round": rounds, "rollouts": n_rollouts, "committed": len(committed), "target": cfg.target_groups})
        if cut:
            stop = "max_rollouts"
            break
    with timer("allocator"):
        closed_ids, decisions = allocator.end_step()
    close(closed_ids, decisions)
    sampler.update(np.asarray(pool_of, np.int64), allocator.units.n.copy(), allocator.units.rsum.copy(), step_)

    eps = allocator.config.eps
    eff = [g for g in committed if g.is_effective(eps)]
    sums = {name: (sum(g.size for g in gs), sum(g.num_tokens for g in gs))
            for name, gs in (("c", committed), ("a", abandoned), ("d", discarded))}
    stats = CollectStats(
        rollouts=n_rollouts, tokens=sum(v[1] for v in sums.values()), rounds=rounds,
        committed_groups=len(committed), effective_groups=len(eff), abandoned_groups=len(abandoned),
        discarded_groups=len(discarded), committed_rollouts=sums["c"][0], abandoned_rollouts=sums["a"][0],
        discarded_rollouts=sums["d"][0], committed_tokens=sums["c"][1], abandoned_tokens=sums["a"][1],
        discarded_tokens=sums["d"][1], prompts_drawn=drawn, stop_reason=stop, target_groups=cfg.target_groups,
        allocator_seconds=timer.total["allocator"], env_seconds=timer.total["env"],
        decisions=int(allocator.metrics().get("alloc/decisions", 0.0) - decisions_before),
        wrong_abandons=wrong if can_tell else None, effective_rollouts=sum(g.size for g in eff),
    )
    if stats.rollouts != stats.committed_rollouts + stats.abandoned_rollouts + stats.discarded_rollouts:
        raise AssertionError(f"accounting broken: {stats}")  # an allocator lost or duplicated a unit
    return CollectResult(groups=tuple(committed), abandoned=tuple(abandoned), discarded=tuple(discarded), stats=stats)


class _Timer:
    """Accumulating named wall-clock timers."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.total[name] += time.perf_counter() - t0
