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

__all__ = ["FEATURED", "SimulatedEnv", "SimulatedEnvConfig", "POPULATIONS", "make_features", "make_population"]

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


Features = dict[str, np.ndarray]
FEATURED: Registry[Callable[[int, np.random.Generator], tuple[np.ndarray, Features]]] = Registry("featured population")
"""Populations whose prompts carry features (``features:NAME``): success rates and ``Prompt.metadata`` columns."""


def _banded(size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Four difficulty bands (shares 0.2 / 0.3 / 0.3 / 0.2): easy Beta(4, 1), middling U(0, 1), hard Beta(0.4, 3),
    and mostly unsolvable (85% at 0, else Beta(0.3, 6)): a mixture pool like 1- to 4-digit sums."""
    band = rng.choice(4, size=size, p=[0.2, 0.3, 0.3, 0.2])
    rates = np.select([band == 0, band == 1, band == 2],
                      [rng.beta(4.0, 1.0, size), rng.uniform(0.0, 1.0, size), rng.beta(0.4, 3.0, size)],
                      np.where(rng.uniform(size=size) < 0.85, 0.0, rng.beta(0.3, 6.0, size)))
    return rates, band


def _columns(band: np.ndarray, rng: np.random.Generator) -> Features:
    """``band`` (categorical) and ``size`` (numeric, ten per band plus noise: a prompt length in tokens)."""
    return {"band": band, "size": 10 * band + np.rint(rng.normal(0.0, 3.0, len(band))).astype(np.int64)}


@FEATURED.register("informative")
def informative(size: int, rng: np.random.Generator) -> tuple[np.ndarray, Features]:
    """``_banded`` rates; the features say each prompt's band."""
    rates, band = _banded(size, rng)
    return rates, _columns(band, rng)


@FEATURED.register("uninformative")
def uninformative(size: int, rng: np.random.Generator) -> tuple[np.ndarray, Features]:
    """``_banded`` rates; the features are another prompt's (independent of the rate)."""
    rates, band = _banded(size, rng)
    return rates, _columns(rng.permutation(band), rng)


@FEATURED.register("misleading")
def misleading(size: int, rng: np.random.Generator) -> tuple[np.ndarray, Features]:
    """``_banded`` rates; for a random half of the prompts the features say the opposite band (easy for unsolvable),
    as a stale difficulty label would."""
    rates, band = _banded(size, rng)
    flip = rng.uniform(size=size) < 0.5
    return rates, _columns(np.where(flip, 3 - band, band), rng)


def make_features(spec: str, size: int, *, seed: int = 0) -> tuple[np.ndarray, Features]:
    """``(rates, features)`` for ``size`` prompts of ``features:NAME`` (``FEATURED``); other specs have no features."""
    if not spec.startswith("features:"):
        return make_population(spec, size, seed=seed), {}
    try:
        fn = FEATURED.get(spec[len("features:"):])
    except KeyError as exc:
        raise ConfigError(f"population: {exc.args[0]}") from None
    rates, features = fn(size, np.random.default_rng([seed, 7919]))
    return np.asarray(rates, np.float64), {k: np.asarray(v) for k, v in features.items()}


def make_population(spec: str, size: int, *, seed: int = 0) -> np.ndarray:
    """Success rates for ``size`` prompts: a registered name, ``beta:A,B``, ``features:NAME`` (the rates of a
    featured population) or ``file:PATH`` (one rate per line).

    A file population is used as is (its length sets the pool size; ``size`` is ignored).
    """
    if spec.startswith("features:"):
        return make_features(spec, size, seed=seed)[0]
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
        features: ``Prompt.metadata`` columns (``{key: values [P]}``); a ``features:NAME`` spec brings its own.
    """

    def __init__(self, rates: ArrayLike | str, *, size: int = 10_000, seed: int = 0,
                 config: SimulatedEnvConfig | dict | None = None,
                 reward_fn: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None = None,
                 features: Features | None = None) -> None:
        if isinstance(rates, str):
            self.rates, own = make_features(rates, size, seed=seed)
            features = features if features is not None else own
        else:
            self.rates = np.asarray(rates, np.float64)
        if self.rates.ndim != 1 or not np.all((self.rates >= 0) & (self.rates <= 1)):
            raise ConfigError("SimulatedEnv: field 'rates': must be a 1-D array of success rates in [0, 1]")
        if config is None or isinstance(config, dict):
            config = validate_config(SimulatedEnvConfig, config or {}, what="SimulatedEnv")
        self.config = config
        self.reward_fn = reward_fn
        self.prompts: Sequence[Prompt] = _LazyPrompts(len(self.rates), features or {})
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
    """``Prompt(id="sim-<i>", metadata=<the features of i>)`` for every pool index, built on access (a pool of
    millions costs nothing)."""

    def __init__(self, size: int, features: Features) -> None:
        self._size = size
        for key, col in features.items():
            if len(col) != size:
                raise ConfigError(f"SimulatedEnv: field 'features': column {key!r} has {len(col)} values for {size} "
                                  "prompts")
        self._features = features

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._size))]
        i = int(i)
        if not -self._size <= i < self._size:
            raise IndexError(i)
        i %= self._size
        return Prompt(id=f"sim-{i}", metadata={k: v[i].item() for k, v in self._features.items()})
