"""The policy's own representation of each prompt, for splitting a pool by it (``sara:group_by=<embedding>``).

A backend that embeds prompts (``sara.envs.base.EmbedsPrompts``: the tiny and HF backends) forwards every rendered
prompt once, without sampling, and returns the mean of its final hidden states over the tokens after the longest
prefix all the prompts share (few-shot examples, a chat header: the part that tells them apart). That forward is the
prefill a generation runs anyway; no rollout is spent. A run whose backend cannot embed (vLLM, a Ray pool) gets the
same representation from the trainer's policy (``policy_embedder``): the weights the backend starts from. Imported
on first use (it imports torch through the policies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sara.policies.hf import HFPolicy
from sara.policies.prefix import common_prefix_len, final_hidden
from sara.policies.tiny_model import PAD, TinyPolicy

__all__ = ["PolicyEmbedder", "embed_hf", "embed_tiny", "policy_embedder", "pooled_states"]


def pooled_states(rows: Sequence[Sequence[int]], hidden: Callable[[Any, Any, int], Any], *, pad_id: int,
                  device: Any = None, batch: int = 32) -> np.ndarray:
    """``[rows, D]`` float32: each row's final hidden states averaged over its tokens after the rows' common prefix.

    Args:
        rows: Prompt token ids (any lengths, at least one token each).
        hidden: ``hidden(ids [B, T], attention_mask [B, T], p) -> [B, T - p, D]``, the final hidden states of
            positions ``p..T-1`` of right-padded rows whose first ``p`` tokens are the same (a causal model: a
            position never sees the padding after it).
        pad_id: Token id written after a row's end (masked out).
        device: Where the forward runs (default: CPU).
        batch: Rows per forward pass (the result does not depend on it beyond float rounding).
    """
    import torch

    if not rows:
        return np.zeros((0, 0), np.float32)
    if min(len(r) for r in rows) == 0:
        raise ValueError("pooled_states: a prompt has no tokens")
    # Pool at least each row's last token: the prefix may not swallow a row whole.
    p = min(common_prefix_len(rows), min(len(r) for r in rows) - 1)
    out = []
    with torch.inference_mode():
        for lo in range(0, len(rows), batch):
            part = rows[lo : lo + batch]
            t = max(len(r) for r in part)
            ids = torch.full((len(part), t), int(pad_id), dtype=torch.long)
            attn = torch.zeros((len(part), t), dtype=torch.long)
            for i, r in enumerate(part):
                ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
                attn[i, : len(r)] = 1
            if device is not None:
                ids, attn = ids.to(device), attn.to(device)
            h = hidden(ids, attn, p).float()  # [B, T - p, D]
            m = attn[:, p:].to(h.dtype)[..., None]
            out.append(((h * m).sum(1) / m.sum(1)).cpu().numpy())
    return np.concatenate(out).astype(np.float32)


def embed_tiny(policy: TinyPolicy, prompts: Sequence[Any]) -> np.ndarray:
    """``pooled_states`` of text ``prompts`` under a ``TinyPolicy`` (the tiny backend's and policy's embedding)."""
    if any(not isinstance(p, str) for p in prompts):
        raise ValueError("the tiny backend and policy take text prompts (Task.chat must be False)")
    rows = [policy.tokenizer.encode(str(p), bos=True) for p in prompts]
    return pooled_states(rows, lambda ids, attn, p: policy.hidden(ids)[:, p:], pad_id=PAD, device=policy.device)


def embed_hf(model: Any, tokenizer: Any, prompts: Sequence[Any], *, pad_id: int, dtype: Any = None) -> np.ndarray:
    """``pooled_states`` of text or chat ``prompts`` under a transformers causal LM in eval mode (its mode restored
    after), the shared prefix forwarded once; ``dtype``: the matmuls' autocast dtype (None: the weights')."""
    import torch

    from sara.backends.text import encode_prompt

    rows = [encode_prompt(tokenizer, p) for p in prompts]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            return pooled_states(rows, lambda ids, attn, p: final_hidden(model, ids, attn, p), pad_id=pad_id,
                                 device=device)
    finally:
        if was_training:
            model.train()


class PolicyEmbedder:
    """``sara.envs.base.EmbedsPrompts`` from a trainable policy (``HFPolicy`` or ``TinyPolicy``): the representation a
    backend on the same weights returns, for runs whose backend cannot embed. Use ``policy_embedder``."""

    def __init__(self, policy: HFPolicy | TinyPolicy) -> None:
        self.policy = policy

    def embed_prompts(self, prompts: Sequence[Any]) -> np.ndarray:
        """``[prompts, D]``: the mean final hidden state over each prompt's tokens after the prompts' common prefix
        (an ``HFPolicy`` in the matmul dtype it trains in)."""
        policy = self.policy
        if isinstance(policy, TinyPolicy):
            return embed_tiny(policy, prompts)
        tok = policy.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        return embed_hf(policy.model, tok, prompts, pad_id=int(pad), dtype=policy.autocast_dtype)


def policy_embedder(policy: Any) -> PolicyEmbedder | None:
    """A ``PolicyEmbedder`` for ``policy`` when it is an ``HFPolicy`` or a ``TinyPolicy``, else None."""
    return PolicyEmbedder(policy) if isinstance(policy, (HFPolicy, TinyPolicy)) else None
