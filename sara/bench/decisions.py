"""Decision throughput: how many per-prompt SARA decisions per second the vectorized allocator makes."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from sara.allocators import make_allocator

__all__ = ["run_decision_bench"]


def run_decision_bench(units: int = 1_000_000, rounds: int = 4, k: int = 8, spec: str = "sara",
                       seed: int = 0) -> dict[str, Any]:
    """Admit ``units`` prompts, then time ``rounds`` synchronous rounds of dispatch + finished (one 0/1 reward per
    dispatched rollout).

    Returns decisions per second over the ``finished`` calls (each probing unit gets one decision per round) and over
    dispatch + finished together.
    """
    rng = np.random.default_rng(seed)
    allocator = make_allocator(spec, k=k)
    allocator.begin_step(target_groups=units, step=0)
    allocator.admit(np.arange(units, dtype=np.int64))
    rates = rng.beta(0.15, 0.15, units)
    t_obs = t_all = 0.0
    decisions = 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        flat = allocator.dispatch(units * k)
        t_plan = time.perf_counter() - t0
        rewards = (rng.random(len(flat)) < rates[flat]).astype(np.float64)
        before = allocator.metrics()["alloc/decisions"]
        t1 = time.perf_counter()
        allocator.finished(flat, rewards)
        t2 = time.perf_counter()
        decisions += int(allocator.metrics()["alloc/decisions"] - before)
        t_obs += t2 - t1
        t_all += t_plan + (t2 - t1)
    return {"units": units, "rounds": rounds, "k": k, "allocator": spec, "decisions": decisions,
            "decisions_per_second": decisions / t_obs, "decisions_per_second_with_dispatch": decisions / t_all}
