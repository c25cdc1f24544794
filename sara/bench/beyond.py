"""Beyond the paper: continuous rewards, rollout trees and streaming allocation vs their baselines, in simulation.

Each comparison runs every allocator on the same simulated pools and rollout seeds (paired), one step per seed.
Wall-clock comes from a latency model on a virtual clock (``sara.envs.sim.latency.LatencyEnv``): synchronous rounds
wait for their slowest rollout; streaming refills a slot the moment it frees and aborts closed units' rollouts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sara.allocators import BudgetAllocator, make_allocator
from sara.bench.allocation import compare_on_env
from sara.bench.summary import group_ratios
from sara.config import validate_config
from sara.driver import DriverConfig, collect
from sara.envs.sim.binary import SimulatedEnv
from sara.envs.sim.continuous import make_continuous_env
from sara.envs.sim.latency import LatencyEnv, LatencyModel
from sara.envs.sim.tree import TreeSimulatedEnv
from sara.samplers import PromptSampler, UniformSampler
from sara.types import CollectResult

__all__ = ["SimResult", "async_vs_sync", "continuous_vs_ds", "simulate", "tree_vs_flat"]


@dataclass
class SimResult:
    """Wall-clock accounting of one simulated step (``simulate``).

    Exact accounting: ``rollouts_started == result.stats.rollouts + rollouts_aborted``.
    """

    wall_s: float
    effective_groups: int
    committed_groups: int
    rollouts_finished: int
    rollouts_aborted: int
    tokens: float
    stop_reason: str
    rollouts_started: int = 0
    result: CollectResult | None = None

    @property
    def seconds_per_effective_group(self) -> float:
        return self.wall_s / max(self.effective_groups, 1)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "result"}
        return {**out, "seconds_per_effective_group": self.seconds_per_effective_group}


def simulate(allocator: BudgetAllocator, env: Any, sampler: PromptSampler, *, target_groups: int,
             latency: LatencyModel | Mapping[str, Any] | None = None, driver: DriverConfig | Mapping[str, Any] | None
             = None, seed: int = 0, step: int | None = None) -> SimResult:
    """One collection step on ``env`` timed by a latency model: ``driver`` as ``sara.driver.collect``'s (default
    synchronous rounds; ``{"barrier": False}`` streams on the model's slots). Tokens include the partial tokens of
    aborted rollouts."""
    lat = latency if isinstance(latency, LatencyModel) else validate_config(LatencyModel, dict(latency or {}),
                                                                            what="latency")
    timed = LatencyEnv(env, latency=lat)
    res = collect(allocator, timed, sampler, target_groups=target_groups, driver=driver, seed=seed, step=step)
    s = res.stats
    return SimResult(timed.clock, s.effective_groups, s.committed_groups, s.rollouts, s.aborted_rollouts, timed.tokens,
                     s.stop_reason, rollouts_started=s.rollouts + s.aborted_rollouts, result=res)


def continuous_vs_ds(population: str = "u-shaped", *, pool_size: int = 20_000, target_groups: int = 512,
                     seeds: int = 3, k: int = 8, noise: float = 0.25,
                     specs: tuple[str, ...] = ("ds", "sara_continuous", "sara_continuous:tau_low=0.2")) -> list[dict]:
    """Rollouts per effective group (std > eps) on the continuous-reward simulator; ratios relative to the first."""
    return compare_on_env(specs, lambda s: make_continuous_env(population, size=pool_size, seed=s, noise=noise),
                          pool_size=pool_size, target_groups=target_groups, seeds=seeds, k=k)


def tree_vs_flat(population: str = "u-shaped", *, pool_size: int = 20_000, target_groups: int = 512, seeds: int = 3,
                 k: int = 8, kappa: float = 2.0, prefix_fraction: float = 0.5,
                 specs: Sequence[str] = ("ds", "sara", "sara_tree:node_prefix=true,nodes=round_robin",
                                         "sara_tree:node_prefix=true")) -> list[dict[str, Any]]:
    """Rollouts and tokens per effective group on ``TreeSimulatedEnv`` (trees for specs that send handles, flat
    independent rollouts for the others), same pools and seeds; ratios relative to the first spec."""
    return compare_on_env(specs, lambda s: TreeSimulatedEnv(population, size=pool_size, seed=s, kappa=kappa,
                                                            prefix_fraction=prefix_fraction),
                          pool_size=pool_size, target_groups=target_groups, seeds=seeds, k=k)


def async_vs_sync(population: str = "u-shaped", *, pool_size: int = 20_000, target_groups: int = 512, seeds: int = 2,
                  k: int = 8, latency: Mapping[str, Any] | None = None,
                  spec: str = "sara") -> dict[str, Any]:
    """Wall-clock per effective group: DS and ``spec`` in synchronous rounds vs ``spec`` streaming with a fresh prompt
    for every idle slot (``fill_idle``), same pools.

    Returns ``{"rows": [{allocator, mode, seconds_per_effective_group, rollouts_per_effective_group, ...}],
    "async_vs_sync_sara": ratio, "async_vs_ds": ratio}`` (ratios of summed wall-clock over summed effective groups).
    """
    lat = validate_config(LatencyModel, dict(latency or {}), what="latency")
    stream = {"barrier": False, "fill_idle": True}
    plan = (("ds", "sync", None), (spec, "sync", None), (spec, "async", stream))
    rows = []
    for name, mode, driver in plan:
        res = [simulate(make_allocator(name, k=k), SimulatedEnv(population, size=pool_size, seed=s),
                        UniformSampler(pool_size, seed=s), target_groups=target_groups, latency=lat, driver=driver,
                        seed=s)
               for s in range(seeds)]
        eff = sum(r.effective_groups for r in res)
        ratios = group_ratios({"rollouts": r.rollouts_finished + r.rollouts_aborted, "tokens": r.tokens,
                               "effective_groups": r.effective_groups} for r in res)
        rows.append({"allocator": name, "mode": mode, "seconds_per_effective_group": sum(r.wall_s for r in res) / eff,
                     "rollouts_per_effective_group": ratios["rollouts_per_effective_group"],
                     "tokens_per_effective_group": ratios["tokens_per_effective_group"],
                     "aborted": sum(r.rollouts_aborted for r in res)})
    by = {(r["allocator"], r["mode"]): r["seconds_per_effective_group"] for r in rows}
    return {"latency": lat.model_dump(), "rows": rows,
            "async_vs_sync_sara": by[(spec, "async")] / by[(spec, "sync")],
            "async_vs_ds": by[(spec, "async")] / by[("ds", "sync")]}
