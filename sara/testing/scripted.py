"""``ScriptedBackend``: a generation backend without a model, for testing tasks, environments and drivers.

A subclass says what the rollout of a request with a given seed answers (``answer``); the base turns text into a
``Completion`` (one token per character, code points as ids, a constant log-prob), records every call and follows
``update_weights`` like a real backend. Example::

    class AlwaysFour(ScriptedBackend):
        def answer(self, request, seed):
            return "4\\n"

    env = TaskEnv("sara/Arithmetic-v0", AlwaysFour())

The streaming mode is ``StreamingScriptedBackend`` (a subclass: derive from it instead): it also implements
``StreamingBackend``; a completion takes ``ticks(request, seed, completion)`` decode ticks (default: a deterministic
1..8 per seed), so completions finish out of order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sara.envs.base import Completion, GenerationRequest, SamplingConfig
from sara.seeding import derive_seeds

__all__ = ["ScriptedBackend", "StreamingScriptedBackend", "prompt_text"]


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


class StreamingScriptedBackend(ScriptedBackend):
    """``ScriptedBackend`` in streaming mode: also a ``StreamingBackend`` (``submit`` / ``poll`` / ``abort`` /
    ``inflight``), deterministic (no wall-clock).

    A submitted completion is ``answer``'s, made at submission; it finishes after ``ticks(request, seed,
    completion)`` ticks of the engine (at most ``slots`` completions tick at once, the rest queue in submission
    order). ``poll`` ticks until at least one finishes and returns every one finished at that tick. ``abort`` returns
    the tokens a completion had "generated": ``num_tokens * elapsed ticks // ticks``.

    Attributes:
        slots: Completions ticking at once.
        per_request_seeds: True: a streamed completion equals ``generate``'s for the same prompt and seed.
        submitted: ``(tag, request)`` of every submitted completion, in order.
        aborted: Tags aborted while in flight, in order.
    """

    per_request_seeds = True

    def __init__(self, slots: int = 4) -> None:
        super().__init__()
        self.slots = int(slots)
        self.submitted: list[tuple[int, GenerationRequest]] = []
        self.aborted: list[int] = []
        self._live: dict[int, list[Any]] = {}  # tag -> [completion, ticks needed, ticks elapsed]

    def ticks(self, request: GenerationRequest, seed: int, completion: Completion) -> int:
        """Decode ticks the completion takes (default: 1..8, a deterministic function of the seed)."""
        return 1 + int(derive_seeds(int(seed), 0x71C5) % np.uint64(8))

    def submit(self, items: Sequence[tuple[int, GenerationRequest]], sampling: SamplingConfig) -> None:
        for tag, req in items:
            if req.n != 1 or int(tag) in self._live:
                raise ValueError(f"{type(self).__name__}.submit: tag {tag}: one seed per request, unique live tags")
            got = self.answer(req, req.seeds[0])
            c = got if isinstance(got, Completion) else self.completion(req, req.seeds[0], got)
            self._live[int(tag)] = [c, max(1, int(self.ticks(req, req.seeds[0], c))), 0]
            self.submitted.append((int(tag), req))

    def poll(self, timeout: float | None = None) -> list[tuple[int, Completion]]:
        while self._live:
            running = list(self._live.items())[: self.slots]
            for _, row in running:
                row[2] += 1
            done = [(tag, row[0]) for tag, row in running if row[2] >= row[1]]
            if done:
                for tag, _ in done:
                    del self._live[tag]
                return done
        return []

    def abort(self, tags: Sequence[int]) -> int:
        out = 0
        for t in tags:
            row = self._live.pop(int(t), None)
            if row is not None:
                out += row[0].num_tokens * row[2] // row[1]
                self.aborted.append(int(t))
        return out

    def inflight(self) -> int:
        return len(self._live)
