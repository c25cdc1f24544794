"""``ScriptedBackend``: a generation backend without a model, for testing tasks, environments and drivers.

A subclass says what the rollout of a request with a given seed answers (``answer``); the base turns text into a
``Completion`` (one token per character, code points as ids, a constant log-prob), records every call and follows
``update_weights`` like a real backend. Example::

    class AlwaysFour(ScriptedBackend):
        def answer(self, request, seed):
            return "4\\n"

    env = TaskEnv("sara/Arithmetic-v0", AlwaysFour())
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sara.envs.base import Completion, GenerationRequest, SamplingConfig

__all__ = ["ScriptedBackend", "prompt_text"]


def prompt_text(request: GenerationRequest) -> str:
    """The request's prompt as text (the last message's content for a chat prompt)."""
    return request.prompt if isinstance(request.prompt, str) else request.prompt[-1]["content"]


class ScriptedBackend:
    """Implements ``sara.envs.base.GenerationBackend``; subclasses override ``answer``.

    Attributes:
        calls: ``(requests, sampling)`` of every ``generate`` call, in order.
        version: The last weights version loaded (0 before any ``update_weights``).
        logprob: The log-prob reported for every generated token.
        prompt_ids: Report ``prompt_token_ids`` (the prompt's code points), as a trainable backend must.
    """

    logprob: float = -0.5
    prompt_ids: bool = True

    def __init__(self) -> None:
        self.calls: list[tuple[list[GenerationRequest], SamplingConfig]] = []
        self.version = 0

    def answer(self, request: GenerationRequest, seed: int) -> str | Completion:
        """The completion of ``request``'s rollout with ``seed``: its text, or a whole ``Completion``."""
        raise NotImplementedError(f"{type(self).__name__} must override answer(request, seed)")

    def completion(self, request: GenerationRequest, seed: int, text: str, *, finish_reason: str = "stop"
                   ) -> Completion:
        """``text`` as a ``Completion`` of ``request`` (what ``answer`` returning a string becomes)."""
        ids = tuple(ord(ch) for ch in text)
        prompt_ids = tuple(ord(ch) for ch in prompt_text(request)) if self.prompt_ids else ()
        return Completion(text=text, token_ids=ids, logprobs=tuple(self.logprob for _ in ids),
                          prompt_token_ids=prompt_ids, finish_reason=finish_reason, seed=seed)

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[list[Completion]]:
        self.calls.append((list(requests), sampling))
        out = []
        for req in requests:
            group = []
            for s in req.seeds:
                got = self.answer(req, s)
                group.append(got if isinstance(got, Completion) else self.completion(req, s, got))
            out.append(group)
        return out

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        self.version = version

    def close(self) -> None:
        pass
