"""A simulated verifiable environment: latent per-prompt success rates, no text.

Rewards are a pure function of each rollout's seed (``reward = U(seed) < rate``), so results do not depend on how a
round is batched or sharded, allocators can be compared on common random numbers, and the simulator can tell, for
analysis only, what an abandoned prompt's full group would have been (``counterfactual_mixed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike
from pydantic import Field

from sara.config import ConfigError, SaraModel, validate_config
from sara.registry import Registry
from sara.seeding import uniform_from_seeds
from sara.types import Prompt, Rollout, RolloutRequest

__all__ = ["SimulatedEnv", "SimulatedEnvConfig", "POPULATIONS", "make_population"]

POPULATIONS: Registry[Callable[[int, np.random.Generator], np.ndarray]] = Registry("population")


@POPULATIONS.register("u-shaped")
def u_shaped(size: int, rng: np.random.Generator) -> np.ndarray:
    """Success rates ~ Beta(0.15, 0.15): most prompts nearly always or never solved (typical of LLM RL)."""
    return rng.beta(0.15, 0.15, size)


@POPULATIONS.register("mid-training")
def mid_training(size: int, rng: np.random.Generator) -> np.ndarray:
    """30% always fail, 20% always succeed, 50% uniform on (0, 1)."""
    kind = rng.choice(3, size=size, p=[0.3, 0.2, 0.5])
    return np.where(kind == 0, 0.0, np.where(kind == 1, 1.0, rng.uniform(0.0, 1.0, size)))


@POPULATIONS.register("uniform")
def uniform_population(size: int, rng: np.random.Generator) -> np.ndarray:
    """Success rates ~ U(0, 1) = Beta(1, 1), the paper's prior."""
    return rng.uniform(0.0, 1.0, size)


def make_population(spec: str, size: int, *, seed: int = 0) -> np.ndarray:
    """Success rates for ``size`` prompts: a registered name, ``beta:A,B`` or ``file:PATH`` (one rate per line).

    A file population is used as is (its length sets the pool size; ``size`` is ignored).
    """
    rng = np.random.default_rng([seed, 7919])
    if spec.startswith("file:"):
        path = Path(spec[5:])
        if not path.is_file():
            raise ConfigError(f"population: file {str(path)!r} does not exist")
        rates = np.loadtxt(path, dtype=np.float64, ndmin=1)
    elif spec.startswith("beta:"):
        try:
            a, b = (float(x) for x in spec[5:].split(","))
        except ValueError:
            raise ConfigError(f"population {spec!r}: expected beta:A,B with positive numbers") from None
        if a <= 0 or b <= 0:
            raise ConfigError(f"population {spec!r}: Beta parameters must be > 0")
        rates = rng.beta(a, b, size)
    else:
        try:
            fn = POPULATIONS.get(spec)
        except KeyError as exc:
            raise ConfigError(f"population: {exc.args[0]}; or use beta:A,B / file:PATH") from None
        rates = fn(size, rng)
    rates = np.asarray(rates, np.float64)
    if rates.ndim != 1 or len(rates) == 0 or not np.all((rates >= 0) & (rates <= 1)):
        raise ConfigError(f"population {spec!r}: success rates must be a non-empty list of numbers in [0, 1]")
    return rates


class SimulatedEnvConfig(SaraModel):
    """Token-length model of the simulator."""

    mean_tokens: float = Field(256.0, gt=0)
    """Mean completion length of a successful rollout, in tokens."""
    fail_length_factor: float = Field(1.5, gt=0)
    """Failed rollouts are this many times longer on average (failed reasoning rambles)."""
    length_sigma: float = Field(0.3, ge=0)
    """Log-normal spread of lengths."""
    max_tokens: int = Field(4096, ge=1)
    """Lengths are clipped to [1, max_tokens]."""


class SimulatedEnv:
    """A ``RolloutEnv`` over latent success rates.

    Args:
        rates: Success rate per prompt ``[P]``, or a population spec (see ``make_population``).
        size: Pool size when ``rates`` is a named population.
        seed: Seed of the population draw.
        config: Token-length model (``SimulatedEnvConfig`` or a dict).
        reward_fn: Optional ``f(rates [m], u [m], seeds [m]) -> rewards [m]``; default Bernoulli ``u < rate``
            (continuous-reward simulators plug in here).
    """

    def __init__(self, rates: ArrayLike | str, *, size: int = 10_000, seed: int = 0,
                 config: SimulatedEnvConfig | dict | None = None,
                 reward_fn: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None = None) -> None:
        self.rates = make_population(rates, size, seed=seed) if isinstance(rates, str) else np.asarray(rates, np.float64)
        if self.rates.ndim != 1 or not np.all((self.rates >= 0) & (self.rates <= 1)):
            raise ConfigError("SimulatedEnv: field 'rates': must be a 1-D array of success rates in [0, 1]")
        if config is None or isinstance(config, dict):
            config = validate_config(SimulatedEnvConfig, config or {}, what="SimulatedEnv")
        self.config = config
        self.reward_fn = reward_fn
        self.prompts: Sequence[Prompt] = _LazyPrompts(len(self.rates))
        self.calls = 0

    def rewards(self, pool_index: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """Vectorized rewards for flat ``(pool_index [m], seeds [m])``."""
        u = uniform_from_seeds(seeds, stream=1)
        rates = self.rates[pool_index]
        if self.reward_fn is not None:
            return np.asarray(self.reward_fn(rates, u, seeds), np.float64)
        return (u < rates).astype(np.float64)

    def num_tokens(self, rewards: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """Vectorized token lengths: log-normal, failed (reward below 0.5) rollouts ``fail_length_factor`` longer."""
        c = self.config
        z = _normal_from_seeds(seeds)
        mean = c.mean_tokens * np.where(rewards < 0.5, c.fail_length_factor, 1.0)
        length = mean * np.exp(c.length_sigma * z - 0.5 * c.length_sigma**2)
        return np.clip(np.rint(length), 1, c.max_tokens).astype(np.int64)

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        """One batched round: ``out[i]`` holds ``requests[i].n`` rollouts."""
        self.calls += 1
        if not requests:
            return []
        counts = np.fromiter((r.n for r in requests), np.int64, count=len(requests))
        pool = np.repeat(np.fromiter((r.pool_index for r in requests), np.int64, count=len(requests)), counts)
        seeds = np.fromiter((s for r in requests for s in r.seeds), np.uint64, count=int(counts.sum()))
        rewards = self.rewards(pool, seeds)
        tokens = self.num_tokens(rewards, seeds)
        out: list[list[Rollout]] = []
        pos = 0
        for req, c in zip(requests, counts):
            out.append([
                Rollout(prompt_id=req.prompt.id, pool_index=req.pool_index, completion="", reward=float(rewards[j]),
                        num_tokens=int(tokens[j]), seed=int(seeds[j]))
                for j in range(pos, pos + c)
            ])
            pos += c
        return out

    def counterfactual_mixed(self, pool_index: np.ndarray, seeds: np.ndarray, eps: float = 1e-6) -> np.ndarray:
        """For analysis only: would each full group (row of ``seeds [m, k]``) have been effective (std > eps)?"""
        pool = np.repeat(np.asarray(pool_index, np.int64), seeds.shape[1])
        r = self.rewards(pool, seeds.reshape(-1)).reshape(seeds.shape)
        return r.std(axis=1) > eps


def _normal_from_seeds(seeds: np.ndarray) -> np.ndarray:
    """Standard normal per seed (Box-Muller on two independent streams)."""
    u1 = uniform_from_seeds(seeds, stream=2)
    u2 = uniform_from_seeds(seeds, stream=3)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)


class _LazyPrompts(Sequence[Prompt]):
    """``Prompt(id="sim-<i>")`` for every pool index, built on access (a pool of millions costs nothing)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._size))]
        i = int(i)
        if not -self._size <= i < self._size:
            raise IndexError(i)
        return Prompt(id=f"sim-{i % self._size}")
