"""Beyond the paper (issue 5): continuous rewards, rollout trees and asynchronous allocation vs their baselines.

Each comparison runs every allocator on the same simulated pools and rollout seeds (paired), one step per seed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sara.allocators import make_allocator
from sara.allocators.samplers import UniformSampler
from sara.bench.allocation import compare_on_env
from sara.bench.summary import group_ratios
from sara.collect_async import simulate_async, simulate_sync
from sara.config import validate_config
from sara.envs.sim.binary import SimulatedEnv
from sara.envs.sim.continuous import make_continuous_env
from sara.envs.sim.latency import LatencyModel
from sara.envs.sim.tree import TreeSimulatedEnv

__all__ = ["async_vs_sync", "continuous_vs_ds", "tree_vs_flat"]


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
                  k: int = 8, latency: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Wall-clock per effective group: DS and SARA in synchronous rounds vs ``sara_async`` streaming, same pools.

    Returns ``{"rows": [{allocator, mode, seconds_per_effective_group, rollouts_per_effective_group, ...}],
    "async_vs_sync_sara": ratio, "async_vs_ds": ratio}`` (ratios of summed wall-clock over summed effective groups).
    """
    lat = validate_config(LatencyModel, dict(latency or {}), what="latency")
    plan = (("ds", "sync", simulate_sync), ("sara", "sync", simulate_sync), ("sara_async", "async", simulate_async))
    rows = []
    for spec, mode, fn in plan:
        res = [fn(make_allocator(spec, k=k), SimulatedEnv(population, size=pool_size, seed=s),
                  UniformSampler(pool_size, seed=s), target_groups=target_groups, latency=lat, seed=s)
               for s in range(seeds)]
        eff = sum(r.effective_groups for r in res)
        ratios = group_ratios({"rollouts": r.rollouts_finished + r.rollouts_aborted, "tokens": r.tokens,
                               "effective_groups": r.effective_groups} for r in res)
        rows.append({"allocator": spec, "mode": mode, "seconds_per_effective_group": sum(r.wall_s for r in res) / eff,
                     "rollouts_per_effective_group": ratios["rollouts_per_effective_group"],
                     "tokens_per_effective_group": ratios["tokens_per_effective_group"],
                     "aborted": sum(r.rollouts_aborted for r in res)})
    by = {r["allocator"]: r["seconds_per_effective_group"] for r in rows}
    return {"latency": lat.model_dump(), "rows": rows, "async_vs_sync_sara": by["sara_async"] / by["sara"],
            "async_vs_ds": by["sara_async"] / by["ds"]}
