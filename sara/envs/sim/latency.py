"""Generation latency for simulated environments: one wrapper for the async simulator and the Ray scaling benchmarks.

``LatencyModel``: an engine with ``slots`` concurrent sequences; a rollout occupies one slot for ``prefill_s + tokens
x per_token_s`` seconds. ``LatencyEnv`` wraps any ``RolloutEnv`` and charges every ``rollout`` round its makespan on
the engine's slots, in one of two ways:

* ``LatencyEnv(env, latency=LatencyModel(...))``: a simulated clock (``clock``) advances by the makespan; nothing
  sleeps (``sara.collect_async.simulate_sync`` times synchronous rounds this way);
* ``LatencyEnv(factory, seconds_per_token)``: an accelerator-bound engine with one sequential slot; the round really
  sleeps ``seconds_per_token`` per generated token (the wait does not use the host CPU), for scaling benchmarks and
  fault-injection tests of the Ray pool on small machines.

Every other attribute (``counterfactual_mixed``, ``rates``, ...) is forwarded to the wrapped environment.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import Field

from sara.config import ConfigError, SaraModel, validate_config
from sara.types import Rollout, RolloutRequest

__all__ = ["LatencyEnv", "LatencyModel", "makespan"]


class LatencyModel(SaraModel):
    """Per-token latency of the simulated engine."""

    slots: int = Field(256, ge=1)
    """Sequences the engine generates concurrently (continuous batching)."""
    per_token_s: float = Field(0.02, gt=0.0)
    """Seconds per generated token of one sequence (decode step time)."""
    prefill_s: float = Field(0.05, ge=0.0)
    """Seconds before the first token of a rollout (prefill + scheduling)."""

    def duration(self, tokens: np.ndarray) -> np.ndarray:
        """Seconds a rollout of ``tokens`` tokens occupies its slot."""
        return self.prefill_s + np.asarray(tokens, np.float64) * self.per_token_s


def makespan(durations: np.ndarray, slots: int) -> float:
    """Time to run jobs in order on ``slots`` parallel slots (each free slot takes the next job)."""
    if len(durations) <= slots:
        return float(durations.max(initial=0.0))
    free = [0.0] * slots
    for d in durations.tolist():
        t = heapq.heappop(free)
        heapq.heappush(free, t + d)
    return max(free)


class LatencyEnv:
    """Wrap an environment with a generation latency (see the module docstring for the two modes).

    Args:
        env: The wrapped ``RolloutEnv``, or a zero-argument callable building it (picklable for Ray actors).
        seconds_per_token: Sleep per generated token of each round (one sequential slot, no prefill).
        latency: A ``LatencyModel`` (or a dict of its fields): the round's makespan advances ``clock``, no sleep.
        sleep: Whether a round really sleeps its latency; default: only with ``seconds_per_token``.

    Attributes:
        clock: Simulated seconds of all rounds so far.
        tokens: Tokens generated so far.
    """

    def __init__(self, env: Any, seconds_per_token: float | None = None, *,
                 latency: LatencyModel | Mapping[str, Any] | None = None, sleep: bool | None = None) -> None:
        if (seconds_per_token is None) == (latency is None):
            raise ConfigError("LatencyEnv: give exactly one of field 'seconds_per_token' or field 'latency'")
        if seconds_per_token is not None:
            if not seconds_per_token >= 0:
                raise ConfigError(f"LatencyEnv: field 'seconds_per_token': must be >= 0 (got {seconds_per_token})")
            self.seconds_per_token: float | None = float(seconds_per_token)
            self.latency: LatencyModel | None = None
        else:
            self.seconds_per_token = None
            self.latency = latency if isinstance(latency, LatencyModel) else validate_config(
                LatencyModel, dict(latency or {}), what="latency")
        self.sleep = (seconds_per_token is not None) if sleep is None else bool(sleep)
        self.env = env if hasattr(env, "rollout") else _build(env)
        self.prompts = self.env.prompts
        self.clock = 0.0
        self.tokens = 0.0

    def round_seconds(self, tokens: np.ndarray) -> float:
        """Latency of one round whose rollouts have ``tokens`` tokens each (in request order)."""
        if self.latency is None:
            return float(self.seconds_per_token) * float(np.sum(tokens))  # type: ignore[arg-type]
        return makespan(self.latency.duration(tokens), self.latency.slots)

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        out = self.env.rollout(requests)
        toks = np.fromiter((r.num_tokens for rs in out for r in rs), np.float64)
        seconds = self.round_seconds(toks)
        self.clock += seconds
        self.tokens += float(toks.sum())
        if self.sleep:
            time.sleep(seconds)
        return out

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.env, name)


def _build(factory: Callable[[], Any]) -> Any:
    if not callable(factory):
        raise ConfigError(f"LatencyEnv: field 'env': expected an environment or a factory, got {type(factory).__name__}")
    return factory()
