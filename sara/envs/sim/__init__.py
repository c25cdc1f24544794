"""Simulated environments (no text, latent success rates): binary, continuous and tree rewards, and latency.

* ``binary``: ``SimulatedEnv`` (Bernoulli rewards from per-prompt rates), ``POPULATIONS``, ``make_population``;
* ``continuous``: ``make_continuous_env`` / ``continuous_reward_fn`` (bounded rewards with boundary atoms);
* ``tree``: ``TreeSimulatedEnv`` (rollout trees with correlated rewards within a branch);
* ``latency``: ``LatencyModel`` / ``LatencyEnv`` (generation time of a round, simulated or slept).
"""

from sara.envs.sim.binary import POPULATIONS, SimulatedEnv, SimulatedEnvConfig, make_population
from sara.envs.sim.latency import LatencyEnv, LatencyModel

__all__ = [
    "LatencyEnv",
    "LatencyModel",
    "POPULATIONS",
    "SimulatedEnv",
    "SimulatedEnvConfig",
    "make_population",
]
