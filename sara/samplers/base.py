"""Prompt samplers: which prompts enter the step next.

A sampler draws pool indices; the driver (``sara.driver.collect``) asks it whenever the allocator wants fresh
prompts. ``update`` feeds back what was observed at the end of a step (for predictive samplers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from sara.config import ConfigError, SaraModel, validate_config

__all__ = ["PromptSampler", "UniformSampler", "UniformSamplerConfig"]


class PromptSampler(ABC):
    """Draws prompt indices from a pool of ``pool_size`` prompts; deterministic given its seed and state."""

    name: ClassVar[str] = "base"
    Config: ClassVar[type[SaraModel] | None] = None
    """The options' pydantic model (``sara.samplers.choose_sampler`` validates a spec by it before the pool exists;
    the constructor takes its fields as keyword arguments). None: the constructor validates its own keyword
    arguments."""
    takes_k: ClassVar[bool] = False
    """True: the sampler scores groups of k (``make_sampler`` passes the run's group size as option ``k``)."""
    takes_population: ClassVar[bool] = False
    """True: the constructor takes ``allocator_population``, the run allocator's grid population split by prompt group
    (``make_sampler`` passes it; ``sara.build.build_allocation`` builds it first)."""

    def __init__(self, pool_size: int, *, seed: int = 0) -> None:
        if pool_size < 1:
            raise ConfigError(f"sampler: field 'pool_size': must be >= 1 (got {pool_size})")
        self.pool_size = int(pool_size)
        self.seed = int(seed)

    @abstractmethod
    def sample(self, m: int) -> np.ndarray:
        """Up to ``m`` pool indices (``int64``); fewer (possibly none) when the pool is exhausted."""

    def capacity(self) -> int | None:
        """Prompts this sampler can still hand out (None = unlimited)."""
        return None

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:  # noqa: B027
        """Feedback after a step: per unit, its prompt, rollouts observed and reward sum."""

    def metrics(self) -> dict[str, float]:
        """What the sampler reports each training step, as ``sampler/...`` keys (none by default)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027
        pass


class UniformSamplerConfig(SaraModel):
    """Options of the uniform sampler."""

    pool_epochs: int | None = Field(None, ge=1)
    """Passes over the prompt pool before it is exhausted (None = unlimited)."""


class UniformSampler(PromptSampler):
    """Uniform without replacement within a pass over the pool; a fresh seeded permutation every pass."""

    name = "uniform"
    Config = UniformSamplerConfig

    def __init__(self, pool_size: int, *, seed: int = 0, pool_epochs: int | None = None) -> None:
        super().__init__(pool_size, seed=seed)
        self.config = validate_config(UniformSamplerConfig, {"pool_epochs": pool_epochs}, what="sampler 'uniform'")
        self.epoch = 0
        self.pos = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.pool_size)

    def capacity(self) -> int | None:
        if self.config.pool_epochs is None:
            return None
        return max(0, (self.config.pool_epochs - self.epoch) * self.pool_size - self.pos)

    def sample(self, m: int) -> np.ndarray:
        out: list[np.ndarray] = []
        while m > 0:
            if self.pos >= self.pool_size:
                if self.config.pool_epochs is not None and self.epoch + 1 >= self.config.pool_epochs:
                    break
                self.epoch += 1
                self.pos = 0
                self._perm = self._permutation(self.epoch)
            take = min(m, self.pool_size - self.pos)
            out.append(self._perm[self.pos : self.pos + take])
            self.pos += take
            m -= take
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.pos = int(state["pos"])
        self._perm = self._permutation(self.epoch)
