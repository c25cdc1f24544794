"""Generation latency for simulated environments: a virtual clock for the driver, and a sleeping engine for Ray.

``LatencyModel``: an engine with ``slots`` concurrent sequences; a rollout occupies one slot for ``prefill_s + tokens
x per_token_s`` seconds. ``LatencyEnv`` wraps any ``RolloutEnv`` in one of two ways:

* ``LatencyEnv(env, latency=LatencyModel(...))``: a simulated engine on a virtual clock (``clock``); nothing sleeps.
  A synchronous round (``rollout``) advances the clock by its makespan on the engine's slots; streaming (``submit`` /
  ``poll`` / ``abort``, ``slots`` = the model's) runs every rollout on its own slot from the moment it is submitted,
  ``poll`` advances the clock to the next completion, and ``abort`` charges a cancelled rollout the tokens it had
  generated. The driver (``sara.driver.collect``) runs on it unchanged in either mode;
* ``LatencyEnv(factory, seconds_per_token)``: an accelerator-bound engine with one sequential slot; a round really
  sleeps ``seconds_per_token`` per generated token (the wait does not use the host CPU), for scaling benchmarks and
  fault-injection tests of the Ray pool on small machines. It does not stream.

Every other attribute (``counterfactual_mixed``, ``rates``, ...) is the wrapped environment's (``EnvWrapper``).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import Field

from sara.config import ConfigError, SaraModel, validate_config
from sara.envs.base import EnvWrapper, RolloutEnv
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


class LatencyEnv(EnvWrapper):
    """Wrap an environment with a generation latency (see the module docstring for the two modes).

    Args:
        env: The wrapped ``RolloutEnv``, or a zero-argument callable building it (picklable for Ray actors).
        seconds_per_token: Sleep per generated token of each round (one sequential slot, no prefill).
        latency: A ``LatencyModel`` (or a dict of its fields): the round's makespan advances ``clock``, no sleep.
        sleep: Whether a round really sleeps its latency; default: only with ``seconds_per_token``.

    Attributes:
        clock: Simulated seconds so far.
        tokens: Tokens generated so far (with the partial tokens of aborted rollouts).
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
        super().__init__(env if isinstance(env, RolloutEnv) else _build(env))
        self.clock = 0.0
        self.tokens = 0.0
        self._running: list[tuple[float, int, int, Rollout, float]] = []  # (finish, seq, tag, rollout, start) heap
        self._seq = 0

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

    # ---- streaming on the virtual clock ------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        """The engine's concurrent sequences (the latency model's ``slots``); no attribute in sleeping mode, which
        does not stream."""
        if self.latency is None:
            raise AttributeError("slots")
        return self.latency.slots

    def _model(self) -> LatencyModel:
        if self.latency is None:
            raise ConfigError("LatencyEnv: streaming needs field 'latency' (a LatencyModel), not 'seconds_per_token'")
        return self.latency

    def submit(self, items: Sequence[tuple[int, RolloutRequest]]) -> None:
        """Start one rollout per item now: generated at once, finishing ``duration(tokens)`` later on the clock."""
        lat = self._model()
        if not items:
            return
        out = self.env.rollout([req for _, req in items])
        for (tag, _), (r,) in zip(items, out):
            heapq.heappush(self._running, (self.clock + float(lat.duration(r.num_tokens)), self._seq, tag, r,
                                           self.clock))
            self._seq += 1

    def poll(self, timeout: float | None = None) -> list[tuple[int, Rollout]]:
        """Advance the clock to the next completion; every rollout finishing at that instant."""
        if not self._running:
            return []
        self.clock = self._running[0][0]
        done = []
        while self._running and self._running[0][0] <= self.clock:
            _, _, tag, r, _ = heapq.heappop(self._running)
            self.tokens += float(r.num_tokens)
            done.append((tag, r))
        return done

    def abort(self, tags: Sequence[int]) -> int:
        """Cancel running rollouts; each is charged the tokens it had generated by now (returned, rounded down)."""
        lat, kill = self._model(), set(tags)
        gone = [e for e in self._running if e[2] in kill]
        if not gone:
            return 0
        self._running = [e for e in self._running if e[2] not in kill]
        heapq.heapify(self._running)
        partial = sum(max(self.clock - start - lat.prefill_s, 0.0) / lat.per_token_s for *_, start in gone)
        self.tokens += partial
        return int(partial)

    def running(self) -> list[int]:
        """Tags of the rollouts running on the simulated engine."""
        return [e[2] for e in self._running]


def _build(factory: Callable[[], Any]) -> Any:
    if not callable(factory):
        raise ConfigError(f"LatencyEnv: field 'env': expected an environment or a factory, got {type(factory).__name__}")
    return factory()
