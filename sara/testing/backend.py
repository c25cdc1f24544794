"""``check_backend``: the conformance check every generation backend (built-in or yours) should pass.

It checks what the trainer relies on. One round of requests with different ``n`` (including a per-request
``max_new_tokens`` override and an empty request): ``out[i]`` holds ``requests[i].n`` completions in seed order; every
completion has its token ids (ints) and non-empty ``prompt_token_ids`` (ints: the trainer trains on prompt + completion
tokens), one finite log-prob <= 0 per token, ``num_tokens`` within the cap, ``finish_reason`` ``"stop"`` or
``"length"`` (``"length"`` exactly at the cap), and a text string.

Weights: the trainer calls ``update_weights(policy.state_dict(), version)`` after every update (version 1, 2, ...; a
resumed run jumps straight to its saved version). The check loads ``state_dict`` with the next version and again with
a version two ahead, and the round must still generate correctly after each load (a ``Completion.policy_version``,
where reported, must name the loaded version).

``logprob_gaps(policy, completions)`` measures how far a backend's log-probs are from the policy's recomputation of
the same tokens (the trainer's importance ratios start from the policy's own values; a large gap means the generator
and the policy disagree about the weights or the tokenization).

Seeds, where the backend honours them (``backend.per_request_seeds`` true, or ``seeded=True``): the same call twice
gives the same tokens, and two completions with the same seed in one call are identical. Backends with one engine
seed (vLLM-cpu) skip these checks; pass ``seeded=False`` explicitly for any other such backend.

Streaming, where the backend has it (``StreamingBackend``: ``slots``, ``submit``, ``poll``, ``abort``,
``inflight``): tags round-trip (every submitted tag comes back exactly once, none other), ``inflight`` follows,
``poll`` with nothing in flight returns ``[]``, ``abort`` returns a token count and the aborted tag never comes back
(unknown tags are ignored), each streamed completion passes the completion checks, and, when seeded, equals (tokens)
``generate``'s for the same prompt and seed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from sara.config import ConfigError
from sara.envs.base import (
    Completion,
    GenerationBackend,
    GenerationRequest,
    SamplingConfig,
    SeedAware,
    StreamingBackend,
    Versioned,
)

__all__ = ["check_backend", "logprob_gaps"]


def check_backend(backend: Any, *, state_dict: Mapping[str, Any] | None = None, prompts: Sequence[Any] = ("1+1=", "2+3="),
                  max_new_tokens: int = 8, seeded: bool | None = None, temperature: float = 1.0) -> dict[str, Any]:
    """Run the conformance checks; raise ``AssertionError`` naming the first violation.

    Args:
        backend: The backend under test (``generate`` / ``update_weights`` / ``close``).
        state_dict: The weights the backend generates from, as the trainer would push them (``policy.state_dict()``);
            loaded with ``update_weights``. With seeded backends the round must give the same tokens after loading
            them. Required: pass the policy's state dict (an empty ``{}`` for a backend without weights).
        prompts: Two or more prompts the backend accepts (text, or chat messages for chat backends).
        max_new_tokens: The round's token cap (the second request asks for half of it).
        seeded: Whether completions are a function of their seeds; ``None`` = ``backend.per_request_seeds`` for a
            ``SeedAware`` backend, else ``True``.
        temperature: Sampling temperature of the round.

    Returns:
        A small report: ``{"completions": ..., "tokens": ..., "seeded": ..., "versions": [...]}`` (the weight
        versions loaded).

    Raises:
        ConfigError: no ``state_dict`` given, or fewer than two prompts.
    """
    assert isinstance(backend, GenerationBackend), (
        f"{type(backend).__name__} does not implement GenerationBackend (generate, update_weights, close)")
    if state_dict is None:
        raise ConfigError("check_backend: field 'state_dict': pass the weights the trainer would push "
                          "(policy.state_dict(); {} for a backend without weights)")
    if len(prompts) < 2:
        raise ConfigError("check_backend: field 'prompts': at least two prompts are needed")
    if seeded is None:
        seeded = backend.per_request_seeds if isinstance(backend, SeedAware) else True
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)
    short = max(1, max_new_tokens // 2)
    requests = [
        GenerationRequest(prompt=prompts[0], seeds=(11, 12, 13)),
        GenerationRequest(prompt=prompts[1], seeds=(21,), max_new_tokens=short),
        GenerationRequest(prompt=prompts[0], seeds=()),
        GenerationRequest(prompt=prompts[1], seeds=(31, 31)),  # the same seed twice
    ]
    assert backend.generate([], sampling) == [], "generate([]) must return []"
    out = _check_round(backend, requests, sampling, "")
    if seeded:
        a, b = out[3]
        assert a.token_ids == b.token_ids, "two completions with the same seed in one call differ"
        again = backend.generate(requests, sampling)
        for i, (x, y) in enumerate(zip(out, again)):
            assert [c.token_ids for c in x] == [c.token_ids for c in y], (
                f"request {i}: the same call twice gave different tokens (seeds not honoured); pass seeded=False "
                "for engine-seeded backends")
    versions = []
    version = int(backend.version) if isinstance(backend, Versioned) else 0
    for step in (1, 2):  # the next version (a training update), then a jump (a resumed run)
        version += step
        backend.update_weights(state_dict, version)
        versions.append(version)
        if isinstance(backend, Versioned):
            assert backend.version == version, f"update_weights(..., {version}) left backend.version={backend.version}"
        after = _check_round(backend, requests, sampling, f"after update_weights(..., {version}): ", version)
        if seeded:
            for i, (x, y) in enumerate(zip(out, after)):
                assert [c.token_ids for c in x] == [c.token_ids for c in y], (
                    f"after update_weights(..., {version}): request {i} changed its tokens although the same weights "
                    "were loaded (update_weights must load state_dict as the generating weights)")
    tokens = sum(c.num_tokens for comps in out for c in comps)
    report = {"completions": sum(len(c) for c in out), "tokens": tokens, "seeded": seeded, "versions": versions}
    if isinstance(backend, StreamingBackend):
        report["streamed"] = _check_streaming(backend, prompts, sampling, seeded)
    return report


def _check_streaming(backend: Any, prompts: Sequence[Any], sampling: SamplingConfig, seeded: bool) -> int:
    """The streaming protocol (see the module docstring); returns the completions streamed."""
    assert int(backend.slots) >= 1, f"slots must be >= 1, got {backend.slots}"
    assert backend.inflight() == 0, f"inflight() is {backend.inflight()} before anything was submitted"
    assert backend.poll(1.0) == [], "poll() with nothing in flight must return []"
    assert backend.abort([12345]) == 0, "abort of an unknown tag must be ignored (0 tokens)"
    items = [(100 + i, GenerationRequest(prompt=prompts[i % 2], seeds=(40 + i,))) for i in range(5)]
    backend.submit(items, sampling)
    assert backend.inflight() == len(items), f"inflight() is {backend.inflight()} after {len(items)} submitted"
    dropped = backend.abort([104])
    assert isinstance(dropped, int) and dropped >= 0, f"abort returned {dropped!r}, expected a token count >= 0"
    assert backend.inflight() == len(items) - 1, "abort did not drop the aborted completion from inflight()"
    got: dict[int, Completion] = {}
    for _ in range(10_000):
        if backend.inflight() == 0:
            break
        for tag, c in backend.poll(60.0):
            assert tag not in got, f"tag {tag} returned twice by poll"
            got[tag] = c
    assert backend.inflight() == 0 and backend.poll(1.0) == [], "poll left completions in flight"
    assert sorted(got) == [100, 101, 102, 103], f"poll returned tags {sorted(got)} for 100..103 (104 aborted)"
    for tag, c in got.items():
        _check_completion(c, f"streamed tag {tag}", sampling.max_new_tokens)
        assert c.seed == 40 + tag - 100, f"streamed tag {tag}: seed {c.seed} != requested {40 + tag - 100}"
    if seeded:
        ref = backend.generate([r for _, r in items[:4]], sampling)
        for (tag, _), comps in zip(items, ref):
            assert got[tag].token_ids == comps[0].token_ids, (
                f"streamed tag {tag}: tokens differ from generate's for the same prompt and seed")
    return len(got)


def _check_round(backend: Any, requests: Sequence[GenerationRequest], sampling: SamplingConfig, when: str,
                 version: int | None = None) -> list[list[Completion]]:
    """One ``generate`` call: counts, seed order and every completion's fields."""
    out = backend.generate(requests, sampling)
    assert isinstance(out, list) and len(out) == len(requests), (
        f"{when}generate returned {len(out) if isinstance(out, list) else type(out).__name__} lists for "
        f"{len(requests)} requests")
    for i, (req, comps) in enumerate(zip(requests, out)):
        assert len(comps) == req.n, f"{when}request {i}: {len(comps)} completions for n={req.n}"
        cap = req.max_new_tokens if req.max_new_tokens is not None else sampling.max_new_tokens
        for j, (seed, c) in enumerate(zip(req.seeds, comps)):
            where = f"{when}request {i} completion {j}"
            _check_completion(c, where, cap)
            assert c.seed == seed, f"{where}: seed {c.seed} != requested {seed} (seed order)"
            reported = c.policy_version
            if version is not None and reported is not None:
                assert reported == version, f"{where}: generated with weights version {reported}, not {version}"
    return out


def _check_completion(c: Completion, where: str, cap: int) -> None:
    assert isinstance(c, Completion), f"{where}: expected a Completion, got {type(c).__name__}"
    assert isinstance(c.text, str), f"{where}: text is {type(c.text).__name__}"
    for name in ("token_ids", "prompt_token_ids", "logprobs"):
        value = getattr(c, name)
        assert isinstance(value, (tuple, list)), (
            f"{where}: {name} is {type(value).__name__}, expected a tuple (the trainer needs it to train)")
    assert all(isinstance(t, int) for t in c.token_ids), f"{where}: token ids must be ints"
    assert len(c.prompt_token_ids) > 0, (
        f"{where}: empty prompt_token_ids (the trainer trains on prompt + completion tokens: return the prompt as "
        "the backend tokenized it)")
    assert all(isinstance(t, int) for t in c.prompt_token_ids), f"{where}: prompt token ids must be ints"
    assert len(c.logprobs) == len(c.token_ids), (
        f"{where}: {len(c.logprobs)} log-probs for {len(c.token_ids)} tokens (must be aligned)")
    assert all(math.isfinite(x) and x <= 1e-6 for x in c.logprobs), f"{where}: log-probs must be finite and <= 0"
    assert c.num_tokens <= cap, f"{where}: {c.num_tokens} tokens exceed the cap {cap}"
    assert c.finish_reason in ("stop", "length"), f"{where}: finish_reason {c.finish_reason!r}"
    if c.finish_reason == "length":
        assert c.num_tokens == cap, f"{where}: finish_reason 'length' with {c.num_tokens} < {cap} tokens"


def logprob_gaps(policy: Any, completions: Sequence[Completion]) -> Any:
    """``|generator log-prob - policy log-prob|`` of every generated token, concatenated (a 1-D float32 tensor).

    The policy scores ``prompt_token_ids + token_ids`` of each completion in one padded batch (``policy.score``);
    e.g. ``gaps.mean()`` is about 0.035 nats for a bf16 generator against a float32 policy of the same weights.
    """
    import torch

    from sara.policies.base import TokenBatch

    seqs = [list(c.prompt_token_ids) + list(c.token_ids) for c in completions]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    att = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for i, (seq, c) in enumerate(zip(seqs, completions)):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        att[i, : len(seq)] = 1
        resp[i, len(c.prompt_token_ids): len(seq)] = 1
    with torch.no_grad():
        lp = policy.score(TokenBatch(ids, att, resp)).logprobs.float().cpu()
    return torch.cat([(lp[i, len(c.prompt_token_ids): len(c.prompt_token_ids) + c.num_tokens]
                       - torch.tensor(c.logprobs, dtype=torch.float32)).abs() for i, c in enumerate(completions)])
