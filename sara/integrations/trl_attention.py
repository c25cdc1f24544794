"""A CPU (pure torch) implementation of TRL's tree attention, so ``AsyncGRPOTrainer`` trains without a GPU.

TRL 1.16's ``AsyncGRPOTrainer`` loads the policy with ``attn_implementation="tree_fa3"``: a micro-batch row is a
prefix trie of samples (a group's shared prompt is forwarded once) and every segment of the trie attends to the K/V of
its root-to-segment path. TRL computes that with the FlashAttention-3 kernel fetched by ``kernels`` — CUDA only, and
downloaded from the Hub. ``use_cpu_tree_attention()`` registers the same function under the same name, computed with
``torch.nn.functional.scaled_dot_product_attention`` and a dense boolean mask built from the trie:

    query position q (in segment s) may attend to key position j  <=>  j is on the root-to-s path and j <= q

which is what ``flash_attn_varlen_func(..., causal=True)`` computes over TRL's gathered ``tree_kv_index`` (the path
ends with the segment itself, so causal alignment is bottom-right). The dense mask is O(N²) in the row's unique
tokens: fine for the few thousand tokens of a CPU row, not meant for long GPU rows (there, TRL's kernel is used).

The trainer registers its kernel in ``__init__`` and transformers looks the function up on every forward, so call
``use_cpu_tree_attention()`` after the trainer is built (``sara.integrations.trl_trainer.async_grpo_trainer`` does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["TREE_ATTENTION", "tree_attention_mask", "cpu_tree_attention", "use_cpu_tree_attention"]

TREE_ATTENTION = "tree_fa3"
"""The attention-implementation name TRL's ``AsyncGRPOTrainer`` loads its model with."""

_LAST: list[Any] = []  # (n_tokens, kv_index, cu_q, cu_k, mask) of the last forward


def tree_attention_mask(n_tokens: int, kv_index: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """``[n_tokens, n_tokens]`` bool: query position q may attend to key position j (see the module docstring)."""
    mask = torch.zeros(n_tokens, n_tokens, dtype=torch.bool, device=kv_index.device)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for s in range(len(cu_q) - 1):
        rows = torch.arange(cu_q[s], cu_q[s + 1], device=kv_index.device)
        cols = kv_index[cu_k[s]:cu_k[s + 1]]
        mask[rows[:, None], cols[None, :]] = True
    return mask & torch.ones_like(mask).tril()


def _cached_mask(n_tokens: int, kv_index: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    # Every layer of one forward gets the same tree tensors: build the mask once per forward, not once per layer.
    # Compared by content (a new forward's tensors may reuse a freed tensor's memory).
    if _LAST and _LAST[0] == n_tokens and all(a.shape == b.shape and torch.equal(a, b)
                                              for a, b in zip(_LAST[1:4], (kv_index, cu_q, cu_k))):
        return _LAST[4]
    mask = tree_attention_mask(n_tokens, kv_index, cu_q, cu_k)
    _LAST[:] = [n_tokens, kv_index.clone(), cu_q.clone(), cu_k.clone(), mask]
    return mask


def cpu_tree_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, *, tree_kv_index: torch.Tensor, tree_cu_seqlens_q: torch.Tensor,
                       tree_cu_seqlens_k: torch.Tensor, tree_max_seqlen_q: int = 0, tree_max_seqlen_k: int = 0,
                       scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """TRL's ``tree_attention`` signature and semantics, on any device (SDPA with the trie's mask).

    ``query`` is ``[1, heads, N, d]`` and ``key`` / ``value`` ``[1, kv_heads, N, d]`` (grouped-query heads are
    repeated); returns ``([1, N, heads, d], None)`` like the kernel path.

    Raises:
        NotImplementedError: a sliding window or logit soft-capping (not needed by the models tested here).
    """
    if sliding_window or softcap:
        raise NotImplementedError("cpu_tree_attention: sliding-window attention and softcap are not implemented")
    n = query.shape[2]
    mask = _cached_mask(n, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key.to(query.dtype), value.to(query.dtype), attn_mask=mask,
                                         scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def use_cpu_tree_attention() -> None:
    """Register ``cpu_tree_attention`` as transformers' ``"tree_fa3"`` attention (and its no-op mask function)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, cpu_tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, lambda **kwargs: None)
