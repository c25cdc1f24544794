"""The policy's own representation of each prompt, for splitting a pool by it (``sara:group_by=<embedding>``).

A backend that embeds prompts (``sara.envs.base.EmbedsPrompts``: the tiny and HF backends) forwards every rendered
prompt once, without sampling, and returns the mean of its final hidden states over the tokens after the longest
prefix all the prompts share (few-shot examples, a chat header: the part that tells them apart). That forward is the
prefill a generation runs anyway; no rollout is spent. Nothing heavy is imported at module level.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sara.policies.prefix import common_prefix_len

__all__ = ["pooled_states"]


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
