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

import torch
from pydantic import Field

from sara.config import SaraModel, validate_config
from sara.envs.base import Completion, GenerationRequest, SamplingConfig
from sara.policies.tiny import TinyPolicy

__all__ = ["TinyBackend", "TinyBackendConfig", "make_tiny_backend"]


class TinyBackendConfig(SaraModel):
    """Options of the tiny backend."""

    max_batch: int = Field(4096, ge=1)
    """Rows sampled per forward batch (larger rounds are split; results do not change)."""


class TinyBackend:
    """``GenerationBackend`` over a ``TinyPolicy`` copy.

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
            for lo in range(0, len(idx), self.config.max_batch):
                part = idx[lo : lo + self.config.max_batch]
                samples = self.policy.sample([rows[r][1] for r in part], [rows[r][2] for r in part],
                                             temperature=sampling.temperature, top_p=sampling.top_p,
                                             max_new_tokens=cap)
                for r, s in zip(part, samples):
                    results[r] = s
        for (i, pids, seed, _), (toks, lps, reason) in zip(rows, results):
            text = self.tokenizer.decode(toks)
            for stop in sampling.stop:  # char tokenizer: cutting the text at a stop string cuts tokens 1:1
                at = text.find(stop)
                if stop and at >= 0:
                    n = at + len(stop)
                    text, toks, lps, reason = text[:n], toks[:n], lps[:n], "stop"
                    break
            out[i].append(Completion(text=text, token_ids=tuple(toks), logprobs=tuple(lps),
                                     prompt_token_ids=tuple(pids), finish_reason=reason, seed=seed,
                                     metadata={"weights_version": self.version}))
        return out

    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load new weights; ``version`` must increase."""
        if version <= self.version:
            raise ValueError(f"weights version must increase: got {version} after {self.version}")
        with torch.no_grad():
            self.policy.load_state_dict({k: v.detach() for k, v in state_dict.items()})
        self.version = int(version)

    def close(self) -> None:
        self.closed = True


def make_tiny_backend(policy: Any, options: Mapping[str, Any] | None = None, **_: Any) -> TinyBackend:
    """Backend factory for ``sara.backends.BACKENDS``: a ``TinyBackend`` generating with ``policy``'s weights."""
    if not isinstance(policy, TinyPolicy):
        raise TypeError(f"the tiny backend needs a TinyPolicy, got {type(policy).__name__}")
    return TinyBackend(policy, options)
