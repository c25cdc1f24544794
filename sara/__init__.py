"""sara: Sequential Adaptive Rollout Allocation for RL with verifiable rewards.

Public API::

    from sara import collect, make_allocator, SimulatedEnv, UniformSampler
    env = SimulatedEnv("u-shaped", size=10_000, seed=0)
    result = collect(make_allocator("sara:tau_low=0.45", k=8), env, UniformSampler(len(env.prompts)), target_groups=256)
"""

from sara.allocators import (
    ALLOCATORS,
    BudgetAllocator,
    DynamicSamplingAllocator,
    SARAAllocator,
    SequentialAllocator,
    UniformAllocator,
    UniformSampler,
    make_allocator,
    make_sampler,
    p_effective,
)
from sara.collect import CollectConfig, collect
from sara.config import ConfigError
from sara.envs import SimulatedEnv
from sara.types import CollectResult, CollectStats, Decision, Group, Prompt, Rollout, RolloutRequest

__version__ = "0.1.0"

__all__ = [
    "ALLOCATORS",
    "BudgetAllocator",
    "CollectConfig",
    "CollectResult",
    "CollectStats",
    "ConfigError",
    "Decision",
    "DynamicSamplingAllocator",
    "Group",
    "Prompt",
    "Rollout",
    "RolloutRequest",
    "SARAAllocator",
    "SequentialAllocator",
    "SimulatedEnv",
    "UniformAllocator",
    "UniformSampler",
    "collect",
    "make_allocator",
    "make_sampler",
    "p_effective",
]
