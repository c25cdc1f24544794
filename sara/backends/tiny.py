"""Generation backend for the tiny transformer policy (``sara.policies.tiny``), in process, on CPU.

Every completion is drawn from its own seed (``GenerationRequest.seeds``), and prompts are bucketed by length without
padding, so results do not depend on how a round is batched or split. The backend owns a separate copy of the policy
(the "generator"); the trainer pushes new weights with ``update_weights`` after each optimizer phase, like it would
to a vLLM engine.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from pydantic import Field

from sara.config import SaraModel, validate_config
from sara.envs.base import Completion, GenerationRequest, SamplingConfig
from sara.policies.tiny import TinyPolicy
from sara.policies.tiny_model import EOS
from sara.seeding import uniform_from_seeds

__all__ = ["TinyBackend", "TinyBackendConfig", "make_tiny_backend"]


class TinyBackendConfig(SaraModel):
    """Options of the tiny backend."""

    forward_rows: int = Field(4096, ge=1, le=65_536)
    """Rows per forward pass (larger batches are split; results do not change), at most 65,536."""
    max_batch_size: int = Field(256, ge=1, le=65_536)
    """The engine's capacity when streaming (``submit`` / ``poll``): completions decoded concurrently, at most 65,536;
    further submissions queue and join as rows finish (continuous batching)."""


class TinyBackend:
    """``GenerationBackend`` and ``StreamingBackend`` over a ``TinyPolicy`` copy.

    Streaming is continuous batching over a pool of live rows: each ``poll`` runs decode ticks (one token for every
    live row, rows grouped by current length since the tiny model has no padding or KV cache) until at least one row
    finishes; finished rows leave, rows submitted since join at the next tick (at most ``max_batch_size`` rows decode, the rest
    wait in submission order). Token ``t`` of a completion with seed ``s`` is drawn exactly as ``generate`` draws it
    (``uniform_from_seeds(s, stream=t)``, inverse CDF), so a streamed completion equals ``generate``'s for the same
    prompt and seed, whatever else is in flight. No wall-clock enters (``poll``'s timeout is ignored).

    Args:
        policy: The policy whose weights generate (copied; the caller's module is never touched).
        config: ``TinyBackendConfig`` or a mapping of its fields.
    """

    def __init__(self, policy: TinyPolicy, config: TinyBackendConfig | Mapping[str, Any] | None = None) -> None:
        self.config = config if isinstance(config, TinyBackendConfig) else validate_config(
            TinyBackendConfig, dict(config or {}), what="backend 'tiny'")
        self.policy = copy.deepcopy(policy).eval()
        for p in self.policy.parameters():
            p.requires_grad_(False)
        self.tokenizer = self.policy.tokenizer
        self.version = 0
        self.closed = False
        self.per_request_seeds = True
        self._rows: dict[int, _Row] = {}  # streaming: tag -> live row, in submission order

    @property
    def slots(self) -> int:
        """Completions decoded concurrently when streaming (``TinyBackendConfig.max_batch_size``)."""
        return self.config.max_batch_size

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[list[Completion]]:
        """Return ``out[i]`` with ``requests[i].n`` completions, in seed order."""
        if self.closed:
            raise RuntimeError("TinyBackend is closed")
        rows: list[tuple[int, list[int], int, int]] = []  # (request, prompt ids, seed, max_new_tokens)
        for i, req in enumerate(requests):
            if not isinstance(req.prompt, str):
                raise ValueError("the tiny backend takes text prompts (Task.chat must be False)")
            ids = self.tokenizer.encode(req.prompt, bos=True)
            cap = req.max_new_tokens if req.max_new_tokens is not None else sampling.max_new_tokens
            rows.extend((i, ids, int(s), int(cap)) for s in req.seeds)
        out: list[list[Completion]] = [[] for _ in requests]
        # Rows with the same cap are sampled together (a cap changes how far a bucket runs, never the draws).
        by_cap: dict[int, list[int]] = {}
        for r, row in enumerate(rows):
            by_cap.setdefault(row[3], []).append(r)
        results: list[Any] = [None] * len(rows)
        for cap, idx in by_cap.items():
            for lo in range(0, len(idx), self.config.forward_rows):
                part = idx[lo : lo + self.config.forward_rows]
                samples = self.policy.sample([rows[r][1] for r in part], [rows[r][2] for r in part],
                                             temperature=sampling.temperature, top_p=sampling.top_p,
                                             max_new_tokens=cap)
                for r, s in zip(part, samples):
                    results[r] = s
        for (i, pids, seed, _), (toks, lps, reason) in zip(rows, results):
            out[i].append(self._completion(pids, seed, toks, lps, reason, sampling, self.version))
        return out

    def _completion(self, pids: list[int], seed: int, toks: list[int], lps: list[float], reason: str,
                    sampling: SamplingConfig, version: int) -> Completion:
        text = self.tokenizer.decode(toks)
        for stop in sampling.stop:  # char tokenizer: cutting the text at a stop string cuts tokens 1:1
            at = text.find(stop)
            if stop and at >= 0:
                n = at + len(stop)
                text, toks, lps, reason = text[:n], toks[:n], lps[:n], "stop"
                break
        return Completion(text=text, token_ids=tuple(toks), logprobs=tuple(lps), prompt_token_ids=tuple(pids),
                          finish_reason=reason, seed=seed, policy_version=version)

    # ---- streaming (StreamingBackend) ---------------------------------------------------------------------------
    def submit(self, items: Sequence[tuple[int, GenerationRequest]], sampling: SamplingConfig) -> None:
        """Queue one completion per ``(tag, request)`` (``request.n == 1``); it joins the batch at the next tick."""
        if self.closed:
            raise RuntimeError("TinyBackend is closed")
        for tag, req in items:
            if req.n != 1:
                raise ValueError(f"TinyBackend.submit: tag {tag}: a streamed request has exactly one seed")
            if int(tag) in self._rows:
                raise ValueError(f"TinyBackend.submit: tag {tag} is already in flight")
            if not isinstance(req.prompt, str):
                raise ValueError("the tiny backend takes text prompts (Task.chat must be False)")
            ids = self.tokenizer.encode(req.prompt, bos=True)
            cap = req.max_new_tokens if req.max_new_tokens is not None else sampling.max_new_tokens
            steps = min(int(cap), self.policy.config.max_len - len(ids))
            if steps <= 0:
                raise ValueError(f"prompt of {len(ids)} tokens leaves no room under max_len "
                                 f"{self.policy.config.max_len}")
            self._rows[int(tag)] = _Row(ids, int(req.seeds[0]), steps, sampling, self.version)

    def poll(self, timeout: float | None = None) -> list[tuple[int, Completion]]:
        """Decode ticks until at least one live row finishes; every finished ``(tag, completion)`` (``[]`` when
        nothing is in flight)."""
        while self._rows:
            live = list(self._rows.items())[: self.config.max_batch_size]
            self._tick([r for _, r in live])
            done = [(tag, r) for tag, r in live if r.done]
            if done:
                for tag, _ in done:
                    del self._rows[tag]
                return [(tag, self._completion(r.pids, r.seed, r.toks, r.lps, "stop" if r.toks[-1] == EOS else "length",
                                               r.sampling, r.version)) for tag, r in done]
        return []

    def abort(self, tags: Sequence[int]) -> int:
        """Drop in-flight rows (unknown tags ignored); returns the tokens they had generated."""
        return sum(len(self._rows.pop(int(t)).toks) for t in tags if int(t) in self._rows)

    def inflight(self) -> int:
        """Completions submitted and neither returned by ``poll`` nor aborted (queued ones included)."""
        return len(self._rows)

    def _tick(self, rows: list[_Row]) -> None:
        """One token for every row: rows of equal length, temperature and top-p share a forward batch."""
        groups: dict[tuple[int, float, float], list[_Row]] = {}
        for r in rows:
            groups.setdefault((len(r.pids) + len(r.toks), r.sampling.temperature, r.sampling.top_p), []).append(r)
        for (_, temp, top_p), grp in groups.items():
            for lo in range(0, len(grp), self.config.forward_rows):
                part = grp[lo: lo + self.config.forward_rows]
                ids = torch.tensor([r.pids + r.toks for r in part], dtype=torch.long, device=self.policy.device)
                seeds = np.asarray([r.seed for r in part], dtype=np.uint64)
                u = uniform_from_seeds(seeds, stream=np.asarray([len(r.toks) for r in part], np.int64))
                nxt, logp = self.policy.draw(ids, torch.as_tensor(u, dtype=torch.float64, device=ids.device),
                                             temperature=temp, top_p=top_p)
                lp = logp.gather(-1, nxt[:, None]).squeeze(-1).tolist()
                for r, t, x in zip(part, nxt.tolist(), lp):
                    r.toks.append(int(t))
                    r.lps.append(float(x))

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load new weights; ``version`` must increase."""
        if version <= self.version:
            raise ValueError(f"weights version must increase: got {version} after {self.version}")
        with torch.no_grad():
            self.policy.load_state_dict({k: v.detach() for k, v in state_dict.items()})
        self.version = int(version)

    def embed_prompts(self, prompts: Sequence[str | Sequence[Mapping[str, str]]]) -> np.ndarray:
        """``[prompts, D]``: the mean final hidden state over each prompt's tokens after the prompts' common prefix
        (``sara.envs.base.EmbedsPrompts``; no sampling)."""
        from sara.backends.embed import embed_tiny

        return embed_tiny(self.policy, prompts)

    def close(self) -> None:
        self.closed = True


class _Row:
    """One streamed completion: prompt ids, seed, token cap, what it generated so far."""

    __slots__ = ("pids", "seed", "steps", "sampling", "version", "toks", "lps")

    def __init__(self, pids: list[int], seed: int, steps: int, sampling: SamplingConfig, version: int) -> None:
        self.pids, self.seed, self.steps, self.sampling, self.version = pids, seed, steps, sampling, version
        self.toks: list[int] = []
        self.lps: list[float] = []

    @property
    def done(self) -> bool:
        return bool(self.toks) and (self.toks[-1] == EOS or len(self.toks) >= self.steps)


def make_tiny_backend(policy: Any, options: Mapping[str, Any] | None = None, **_: Any) -> TinyBackend:
    """Backend factory for ``sara.backends.BACKENDS``: a ``TinyBackend`` generating with ``policy``'s weights."""
    if not isinstance(policy, TinyPolicy):
        raise TypeError(f"the tiny backend needs a TinyPolicy, got {type(policy).__name__}")
    return TinyBackend(policy, options)
