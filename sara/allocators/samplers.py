"""Prompt samplers: which prompts enter the step next.

A sampler draws pool indices; ``collect`` asks it whenever the allocator wants fresh prompts. ``update`` feeds back
what was observed at the end of a step (for predictive samplers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import Field

from sara.config import ConfigError, SaraModel, validate_config
from sara.registry import Registry

__all__ = ["PromptSampler", "UniformSampler", "UniformSamplerConfig", "SAMPLERS", "make_sampler"]


class PromptSampler(ABC):
    """Draws prompt indices from a pool of ``pool_size`` prompts; deterministic given its seed and state."""

    name = "base"
    takes_k: bool = False  # True: make_sampler passes the allocator's group size as option ``k``

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

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027
        pass


class UniformSamplerConfig(SaraModel):
    """Options of the uniform sampler."""

    epochs: int | None = Field(None, ge=1)
    """Passes over the pool before it is exhausted (None = unlimited)."""


class UniformSampler(PromptSampler):
    """Uniform without replacement within an epoch; a fresh seeded permutation every epoch."""

    name = "uniform"

    def __init__(self, pool_size: int, *, seed: int = 0, epochs: int | None = None) -> None:
        super().__init__(pool_size, seed=seed)
        self.config = validate_config(UniformSamplerConfig, {"epochs": epochs}, what="sampler 'uniform'")
        self.epoch = 0
        self.pos = 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.pool_size)

    def capacity(self) -> int | None:
        if self.config.epochs is None:
            return None
        return max(0, (self.config.epochs - self.epoch) * self.pool_size - self.pos)

    def sample(self, m: int) -> np.ndarray:
        out: list[np.ndarray] = []
        while m > 0:
            if self.pos >= self.pool_size:
                if self.config.epochs is not None and self.epoch + 1 >= self.config.epochs:
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


SAMPLERS: Registry[type[PromptSampler]] = Registry("prompt sampler")
SAMPLERS.register("uniform", UniformSampler)


def make_sampler(spec: str | PromptSampler, pool_size: int, *, seed: int = 0, k: int | None = None) -> PromptSampler:
    """Build a sampler from ``"name"`` / ``"name:key=value,..."`` for a pool of ``pool_size`` prompts.

    ``k`` (the allocator's group size) is passed to samplers that score groups (``takes_k``) unless the spec sets it.
    """
    if isinstance(spec, PromptSampler):
        return spec
    cls, options = SAMPLERS.from_spec(spec)
    if k is not None and getattr(cls, "takes_k", False) and "k" not in options:
        options = {**options, "k": int(k)}
    try:
        return cls(pool_size, seed=seed, **options)
    except TypeError as exc:
        raise ConfigError(f"sampler {spec!r}: {exc}") from None
