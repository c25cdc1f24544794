"""Distributed rollouts on Ray: a pool of actors behind the ordinary backend / environment protocols.

Two pools share one machinery:

- ``RayRolloutPool`` is a ``GenerationBackend``: N actors, each owning a generation backend (tiny policy, HF, vLLM)
  built *inside the actor* from a picklable factory or a backend spec string. A task env on the driver uses it like any
  other backend, so ``collect`` and the allocators do not change.
- ``RayEnvPool`` is a ``RolloutEnv``: N actors, each owning a whole environment (e.g. ``SimulatedEnv``, or a task on a
  backend, so verification also runs on the workers).

Each round (one ``generate`` / ``rollout`` call) is cut into shards, one per worker, balanced by *expected tokens*
(a running per-prompt mean of generated tokens), not by request count; a request larger than a fair share is split by
seeds. Results come back in request order. Rollout ``j`` of a unit carries its own seed, so with per-seed backends
(the simulator, the tiny policy's sampler) results do not depend on the split; backends that only seed per engine
(vLLM on CPU) keep exact accounting but not bitwise equality.

Weights: ``update_weights(state, version)`` puts the state into the object store ONCE and every actor loads it from
there before the call returns; every generation call carries the pool's version and an actor holding another version
refuses it (``StaleWeightsError``), so no stale weights can generate a round.

Faults: when a shard fails (the actor died, was killed, timed out or raised), the worker is replaced by a fresh actor,
the current weights are reloaded into it, and the same shard (same requests, same seeds) is sent again, so the round
returns exactly the rollouts it would have returned without the failure: none lost, none counted twice. A worker that
fails ``max_restarts + 1`` times in a row ends the run with ``WorkerFailedError`` naming the worker and what it was
doing.

Streaming (``submit`` / ``poll`` / ``abort`` under integer tags, ``sara.envs.base.StreamingBackend`` /
``StreamingEnv``): both pools route single requests to the actor with the most free slots, keep one ``poll`` call in
flight per busy actor, and re-issue a failed actor's in-flight rollouts once (same tag, same seed) to another actor.
Actors whose backend / env does not stream run its batch call on their queued requests (``MicroBatchStream``).

Modules: ``config`` (``RayPoolConfig``, ``RayTrainOptions``; light, the trainer's config imports it), ``cluster``
(``init_ray``), ``splitter`` (``TokenEstimator``, ``split_round``), ``actor`` (the worker body, ``build_object``),
``base`` (the shared pool machinery), ``stream`` (streaming, the pools' base), ``pool`` (the two pools, ``ray_backend_factory``). The names below are imported
on first use and ``ray`` itself only when a pool starts, so ``import sara.backends.ray`` stays light.
"""


from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "RayPoolConfig": "config", "RayTrainOptions": "config", "Factory": "config",
    "init_ray": "cluster",
    "TokenEstimator": "splitter", "split_round": "splitter",
    "StaleWeightsError": "actor", "WorkerFailedError": "actor", "build_object": "actor",
    "MicroBatchStream": "actor", "streams_natively": "actor", "StreamingPool": "stream",
    "RayRolloutPool": "pool", "RayEnvPool": "pool", "ray_backend_factory": "pool",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
