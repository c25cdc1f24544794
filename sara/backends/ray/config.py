"""Options of the Ray pools: ``RayPoolConfig`` and the trainer's ``RayTrainOptions`` (``TrainConfig.ray``).

Light on purpose (pydantic and ``sara.config`` only): the trainer's config imports it without importing Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import Field

from sara.config import SaraModel

__all__ = ["Factory", "RayPoolConfig", "RayTrainOptions"]

Factory = Callable[[], Any] | str
"""A zero-argument picklable callable that builds the worker's backend / env (e.g. ``functools.partial(...)``), or a
backend spec string ``"name:key=value,..."`` resolved in the worker through ``sara.backends.BACKENDS``."""


class RayPoolConfig(SaraModel):
    """Options of a Ray rollout pool (``sara train --ray`` fills ``num_workers`` and ``address``)."""

    num_workers: int = Field(2, ge=1, le=1024)
    """Number of actors (one engine each; on a GPU cluster usually one per GPU), at most 1024."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per actor."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved per actor (1 for a vLLM engine per GPU; fractions share a GPU)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources per actor, e.g. ``{"accelerator_type:H100": 0.001}``."""
    max_restarts: int = Field(3, ge=0, le=1000)
    """Consecutive failures a worker may have (each followed by a restart and a retry) before the run ends, at most
    1000."""
    call_timeout_s: float | None = Field(None, gt=0)
    """A generation shard still running after this many seconds counts as a failure (actor killed, restarted, shard
    retried). Starting actors and loading weights are not timed. None = wait as long as it takes."""
    balance: str = Field("tokens", pattern="^(tokens|requests)$")
    """How a round is split: ``tokens`` (expected generated tokens per request) or ``requests`` (rollout count)."""
    split_requests: bool = True
    """Split one request's seeds across workers when it is bigger than a fair share (turn off to keep every prompt's
    rollouts in one engine, e.g. for prefix caching). Always off for backends without per-request seeds."""
    address: str | None = None
    """Ray cluster address (``"auto"``, ``"ray://host:10001"``); None starts a local cluster if none is running."""
    runtime_env: dict[str, Any] | None = None
    """Ray ``runtime_env`` for the actors (env vars, working dir, pip packages)."""
    log_to_driver: bool = False
    """Forward the workers' stdout/stderr to the driver (when this pool starts Ray)."""
    micro_batch: int = Field(16, ge=1, le=65536)
    """Streaming over a backend / env that does not stream itself: requests per batch call on each actor (that
    actor's capacity, ``MicroBatchStream``; at most 65,536). A backend that streams reports its own capacity (``slots``)."""
    stream_order: str = Field("finish", pattern="^(finish|tag)$")
    """Streaming: what one ``poll`` returns. ``finish``: every rollout finished so far, as soon as one is (lowest
    latency; which rollouts arrive together depends on timing). ``tag``: only the oldest in-flight rollout (smallest
    tag), once it finished: the driver then sees the same sequence whatever the timing, the number of workers or
    failed actors (with per-seed backends: the same committed groups), at the cost of head-of-line waiting."""
    stream_poll_s: float = Field(0.1, gt=0)
    """Streaming: the longest one actor-side ``poll`` waits on an asynchronous engine before returning empty-handed, so
    queued submits / aborts / weight loads reach the actor (in-process engines ignore it)."""


class RayTrainOptions(RayPoolConfig):
    """``TrainConfig.ray`` (``sara train --ray --num-workers N --ray-address ADDR``): the pool options plus a switch."""

    enabled: bool = False
    """Generate on Ray actors: each of ``num_workers`` actors owns one copy of the configured backend."""
