"""Shared-prefix helpers used by the training forward (``HFPolicy.score_at``) and the HF backend's shared-prefix
prefill (``sara.backends.hf_shared``): the length of the leading tokens a set of sequences shares, a KV cache of one
prefix row broadcast to many rows, and a causal LM's final hidden states with the shared prefix forwarded once (the
training forward and the HF backend's prompt embedding).

A prefix of ``P`` tokens forwarded once gives keys / values ``[1, H, P, D]`` per layer; ``broadcast_cache`` turns them
into a ``DynamicCache`` of ``B`` rows (``expand``: no copy until the cache appends the rows' own tokens, and under
autograd the rows' gradients sum back into the one prefix). The rows then continue at positions ``P, P + 1, ...``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["broadcast_cache", "common_prefix_len", "final_hidden", "prefix_layers"]


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every sequence of ``seqs`` starts with (0 for no sequences).

    Args:
        seqs: Token id sequences (any lengths).
    """
    if not seqs:
        return 0
    first, n = seqs[0], min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def broadcast_cache(layers: Sequence[tuple[Any, Any]], rows: int, config: Any = None) -> Any:
    """A ``transformers.DynamicCache`` holding one prefix's keys / values for each of ``rows`` rows.

    Args:
        layers: Per layer ``(keys, values)``, each ``[1, H, P, D]`` (or already ``[rows, H, P, D]``).
        rows: Rows of the batch that continues after the prefix.
        config: The model config (``DynamicCache(config=...)`` picks each layer's cache type); None = plain layers.

    Returns:
        A ``DynamicCache`` whose layer ``i`` holds ``layers[i]`` expanded to ``[rows, H, P, D]``.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), i)
    return cache


def prefix_layers(model: Any, ids: Any, p: int, given: Sequence[tuple[Any, Any]] | None = None, q: int = 0
                  ) -> list[tuple[Any, Any]]:
    """Per layer ``(keys, values)`` ``[1, H, p, D]`` of the first ``p`` tokens of ``ids[0]`` (a transformers causal LM).

    Args:
        model: The causal LM.
        ids: Token ids ``[B, T]`` (only row 0's first ``p`` are read).
        p: Tokens of the prefix (``>= 1``).
        given: The keys / values of its first ``q`` tokens, already forwarded (``[1, H, q, D]`` per layer): only
            tokens ``q..p-1`` run, on top of them. None = run all ``p``.
        q: Tokens ``given`` holds (``<= p``).
    """
    if given is not None and q >= p:
        return list(given)
    import torch
    from transformers import DynamicCache

    cache = broadcast_cache(given, 1, model.config) if given is not None else DynamicCache(config=model.config)
    positions = torch.arange(q, p, device=ids.device)[None]
    pre = model.get_decoder()(input_ids=ids[:1, q:p], position_ids=positions, past_key_values=cache,
                              use_cache=True).past_key_values
    return [(layer.keys, layer.values) for layer in pre.layers]


def final_hidden(model: Any, ids: Any, attn: Any, p: int, given: Sequence[tuple[Any, Any]] | None = None,
                 q: int = 0) -> Any:
    """Final hidden states ``[B, T - p, D]`` of positions ``p..T-1`` of a transformers causal LM, the first ``p``
    tokens (the same in every row of ``ids [B, T]``) forwarded once and broadcast (``attn [B, T]``: 1 on real
    tokens); ``given`` / ``q``: the first ``q`` of them already forwarded (``prefix_layers``)."""
    decoder = model.get_decoder()
    if p == 0:
        return decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    import torch

    b, t = ids.shape
    cache = broadcast_cache(prefix_layers(model, ids, p, given, q), b, model.config)
    positions = torch.arange(p, t, device=ids.device).expand(b, -1)
    return decoder(input_ids=ids[:, p:], attention_mask=attn, position_ids=positions, past_key_values=cache,
                   use_cache=True).last_hidden_state
