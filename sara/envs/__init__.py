"""Environments: verifiable tasks on generation backends, and the simulator.

The generation backends themselves (tiny, HF, vLLM, Ray pools) live in ``sara.backends`` (a layer above: envs never
import them) and import their heavy libraries lazily.
"""

from sara.envs.base import Completion, GenerationBackend, GenerationRequest, RolloutEnv, SamplingConfig
from sara.envs.sim.binary import POPULATIONS, SimulatedEnv, SimulatedEnvConfig, make_population
from sara.envs.task_env import TaskEnv

__all__ = [
    "Completion",
    "GenerationBackend",
    "GenerationRequest",
    "POPULATIONS",
    "RolloutEnv",
    "SamplingConfig",
    "SimulatedEnv",
    "SimulatedEnvConfig",
    "TaskEnv",
    "make_population",
]
