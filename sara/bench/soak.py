"""Soak: many collection steps on the simulator with random budgets, targets, allocators, driver modes and injected
environment exceptions; exact accounting checked on every step and memory watched over the run.

``soak(steps)`` keeps one instance per allocator spec (so their cross-step state, e.g. empirical priors, lives the
whole run) and one shared prompt sampler; each step draws an allocator, a target, an optional rollout budget, an
optional ``max_rounds``, and synchronous rounds or streaming (random slots, sometimes work-conserving admission) on a
simulated engine (``LatencyEnv``). The environment raises ``InjectedFault`` in one call of a random share of the
steps: the step fails, the next step must run normally. Checked per successful step: the rollouts the environment generated during
the step equal ``stats.rollouts + stats.aborted_rollouts`` and committed + abandoned + discarded rollouts equal
``stats.rollouts``; the stop reason is one the driver documents; the budget is respected. Over the run: every rollout
generated is accounted for by a successful step or a failed one, and the resident memory after the warm-up grows by
less than ``max_rss_growth_mb``.

Run: ``sara bench soak --steps 10000`` (prints steps, failures, rollouts, peak RSS and RSS growth).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import numpy as np

from sara.envs.base import EnvWrapper

__all__ = ["soak", "InjectedFault", "SOAK_ALLOCATORS"]

SOAK_ALLOCATORS = ("uniform", "ds", "sara", "sara_paper", "sara_paper:probe=2/1", "sara_paper:prior=empirical",
                   "sara:completion=as_is", "bayes_optimal", "sara_continuous", "sara_tree")
STOPS = {"target_reached", "max_rollouts", "max_step_rollouts", "max_rounds", "pool_exhausted", "allocator_done"}


class InjectedFault(RuntimeError):
    """Raised by the soak environment on purpose."""


class _FaultyEnv(EnvWrapper):
    """The simulator, failing one call of a share of the steps (``arm``) and counting every rollout it generates."""

    def __init__(self, env: Any, fault_rate: float, seed: int) -> None:
        super().__init__(env)
        self.fault_rate = fault_rate
        self.rng = np.random.default_rng(seed)
        self.generated = 0
        self.fail_at = -1  # calls left before the armed fault (-1: none in this step)

    def arm(self) -> None:
        """A new step: with probability ``fault_rate`` one of its first few calls raises."""
        self.fail_at = int(self.rng.integers(0, 4)) if self.rng.random() < self.fault_rate else -1

    def rollout(self, requests: Any) -> Any:
        if self.fail_at == 0:
            self.fail_at = -1
            raise InjectedFault("injected environment failure")
        self.fail_at -= self.fail_at > 0
        out = self.env.rollout(requests)
        self.generated += sum(len(g) for g in out)
        return out


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(steps: int = 10_000, *, seed: int = 0, k: int = 8, pool: int = 20_000, fault_rate: float = 0.02,
         allocators: tuple[str, ...] = SOAK_ALLOCATORS, warmup: int | None = None,
         max_rss_growth_mb: float = 64.0) -> dict[str, Any]:
    """Run the soak; returns its numbers. Raises ``AssertionError`` on an accounting or memory violation."""
    from sara.allocators import make_allocator
    from sara.driver import collect
    from sara.envs import SimulatedEnv
    from sara.envs.sim.latency import LatencyEnv
    from sara.samplers import UniformSampler

    rng = np.random.default_rng(seed)
    faulty = _FaultyEnv(SimulatedEnv("u-shaped", size=pool, seed=seed), fault_rate, seed + 1)
    env = LatencyEnv(faulty, latency={"slots": 64})
    sampler = UniformSampler(pool, seed=seed)
    instances = {spec: make_allocator(spec, k=k) for spec in allocators}
    warmup = max(1, steps // 10) if warmup is None else warmup
    totals = {"ok": 0, "failed": 0, "rollouts": 0, "failed_rollouts": 0, "committed_groups": 0}
    stops: dict[str, int] = {}
    rss_warm = rss_peak = _rss_mb()
    t0 = time.perf_counter()
    for step in range(steps):
        spec = allocators[int(rng.integers(len(allocators)))]
        target = int(rng.integers(1, 65))
        budget = int(rng.integers(k, 40 * k)) if rng.random() < 0.5 else None
        rounds = int(rng.integers(1, 30)) if rng.random() < 0.2 else 1000
        stream = bool(rng.random() < 0.3)
        driver = ({"barrier": False, "slots": int(rng.integers(1, 65)), "fill_idle": bool(rng.random() < 0.3)}
                  if stream else {"max_rounds": rounds})
        before = faulty.generated
        faulty.arm()
        try:
            result = collect(instances[spec], env, sampler, target_groups=target, max_rollouts=budget,
                             driver=driver, seed=seed, step=step)
        except InjectedFault:
            totals["failed"] += 1
            totals["failed_rollouts"] += faulty.generated - before
            env.abort(env.running())  # what the failed step left on the simulated engine
            continue
        st = result.stats
        made = faulty.generated - before
        in_groups = sum(g.size for g in (*result.groups, *result.abandoned, *result.discarded))
        assert made == st.rollouts + st.aborted_rollouts and st.rollouts == in_groups, (step, spec, made, st)
        assert st.committed_rollouts + st.abandoned_rollouts + st.discarded_rollouts == st.rollouts, (step, spec)
        assert st.stop_reason in STOPS, st.stop_reason
        assert stream or st.rounds <= rounds  # max_rounds bounds synchronous rounds (streaming counts polls)
        assert st.stop_reason != "target_reached" or st.committed_groups >= target
        totals["ok"] += 1
        totals["rollouts"] += st.rollouts + st.aborted_rollouts
        totals["committed_groups"] += st.committed_groups
        stops[st.stop_reason] = stops.get(st.stop_reason, 0) + 1
        if step + 1 == warmup:
            rss_warm = _rss_mb()
        rss_peak = max(rss_peak, _rss_mb()) if step % 100 == 0 else rss_peak
    rss_end = _rss_mb()
    rss_peak = max(rss_peak, rss_end)
    assert faulty.generated == totals["rollouts"] + totals["failed_rollouts"], "a rollout was lost or counted twice"
    growth = rss_end - rss_warm
    assert growth < max_rss_growth_mb, f"resident memory grew {growth:.1f} MB after the warm-up"
    return {"steps": steps, **totals, "stop_reasons": stops, "allocators": list(allocators),
            "rss_after_warmup_mb": round(rss_warm, 1), "rss_end_mb": round(rss_end, 1),
            "rss_peak_mb": round(rss_peak, 1), "rss_growth_mb": round(growth, 1),
            "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "seconds": round(time.perf_counter() - t0, 1)}
