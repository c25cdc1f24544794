"""Continuous (bounded) rewards for the simulator: the population behind ``sara_continuous``'s benchmarks.

A prompt's latent rate ``p`` (any population of ``sara.envs.sim.binary``) maps to a reward location
``mu = (1 + 2 spread) p - spread``; rewards are ``clip(mu + noise * z, 0, 1)`` with ``z`` standard normal from the
rollout seed, so easy and hopeless prompts pile up on the boundary atoms, as partial-credit rewards do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from scipy.special import ndtri

from sara.config import ConfigError
from sara.envs.sim.binary import SimulatedEnv

__all__ = ["continuous_reward_fn", "make_continuous_env"]


def continuous_reward_fn(noise: float = 0.25, spread: float = 0.5, low: float = 0.0,
                         high: float = 1.0) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    """A ``SimulatedEnv`` ``reward_fn``: ``clip(mu + noise * z, low, high)``, ``mu = (1 + 2 spread) p - spread``.

    Args:
        noise: Per-rollout std of the reward before clipping (in units of ``high - low``).
        spread: How far beyond the bounds the locations of the easiest / hardest prompts lie.
        low, high: Reward bounds.
    """
    for name, value in (("noise", noise), ("spread", spread)):
        if not value >= 0:
            raise ConfigError(f"continuous_reward_fn: field '{name}': must be >= 0 (got {value})")
    if not high > low:
        raise ConfigError(f"continuous_reward_fn: field 'high': must be greater than field 'low' (got high={high}, "
                          f"low={low})")

    def reward_fn(rates: np.ndarray, u: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        z = ndtri(np.clip(u, 1e-12, 1 - 1e-12))
        mu = (1.0 + 2.0 * spread) * rates - spread
        return low + (high - low) * np.clip(mu + noise * z, 0.0, 1.0)

    return reward_fn


def make_continuous_env(population: str | np.ndarray = "u-shaped", *, size: int = 10_000, seed: int = 0,
                        noise: float = 0.25, spread: float = 0.5, **env_options: Any) -> SimulatedEnv:
    """A ``SimulatedEnv`` with continuous rewards in [0, 1] (see ``continuous_reward_fn``)."""
    return SimulatedEnv(population, size=size, seed=seed, reward_fn=continuous_reward_fn(noise, spread),
                        **env_options)
