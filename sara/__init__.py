"""sara: Sequential Adaptive Rollout Allocation for RL with verifiable rewards.

Public API::

    from sara import collect, make_allocator, SimulatedEnv, UniformSampler
    env = SimulatedEnv("u-shaped", size=10_000, seed=0)
    result = collect(make_allocator("sara", k=8), env, UniformSampler(len(env.prompts)), target_groups=256)
"""

from sara.allocators import (
    ALLOCATORS,
    BudgetAllocator,
    DynamicSamplingAllocator,
    ProtocolError,
    SARAAllocator,
    SARAPaperAllocator,
    SequentialAllocator,
    UniformAllocator,
    make_allocator,
    p_effective,
)
from sara.config import ConfigError
from sara.driver import DriverConfig, collect
from sara.envs import SimulatedEnv
from sara.samplers import UniformSampler, make_sampler
from sara.types import CollectResult, CollectStats, Decision, Group, Prompt, Rollout, RolloutRequest

__version__ = "0.1.0"

__all__ = [
    "ALLOCATORS",
    "BudgetAllocator",
    "CollectResult",
    "CollectStats",
    "ConfigError",
    "Decision",
    "DriverConfig",
    "DynamicSamplingAllocator",
    "Group",
    "Prompt",
    "ProtocolError",
    "Rollout",
    "RolloutRequest",
    "SARAAllocator",
    "SARAPaperAllocator",
    "SequentialAllocator",
    "SimulatedEnv",
    "UniformAllocator",
    "UniformSampler",
    "collect",
    "make_allocator",
    "make_sampler",
    "p_effective",
]
