"""Two CPU kernel paths every transformers causal LM that sara loads or copies takes (``sara.hub.resolve_hf_model``):
grouped-query attention without repeated keys (``group_attention``) and a dense LM-head input (``contiguous_head``).

**Grouped attention.** A model with fewer key / value heads than query heads (grouped-query attention: SmolLM2-135M has 9 query heads over
3 key / value heads) runs transformers' ``sdpa`` attention by copying every key / value head once per query head of
its group (``repeat_kv``) whenever the call has an attention mask, then calling
``torch.nn.functional.scaled_dot_product_attention``. A batch of left-padded rows always has a mask, so every decode
step copies each layer's whole KV cache (``group`` times over) and the kernel then reads the copies: on a CPU that copy
and the reading of it are most of a decode step at a few hundred cached positions.

``torch``'s SDPA takes the grouped heads itself (``enable_gqa=True``): on a CPU its kernels read each key / value
head for the query heads of its group with no copy, with or without a mask; its forward gives the same numbers, its
gradients the same up to float rounding (the group's sum runs in another order).
``group_attention(model)`` registers that function with transformers (``GROUPED_SDPA``) and switches a model whose
attention is ``sdpa`` and grouped to it. Calls on another device, or with what the plain function handles and this one
does not (a paged cache, a position bias), go to transformers' own ``sdpa`` function unchanged.

**Dense head input.** See ``contiguous_head``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["GROUPED_SDPA", "contiguous_head", "group_attention", "grouped_sdpa_attention"]

GROUPED_SDPA = "sara_grouped_sdpa"
"""The attention-implementation name ``group_attention`` registers and switches a model to."""


def grouped_sdpa_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, Hq, Q, D]``, ``key`` / ``value [B, Hkv, K, D]``
    (``Hkv`` divides ``Hq``), ``attention_mask`` boolean or additive, broadcastable to ``[B, Hq, Q, K]``; returns
    ``([B, Q, Hq, D], None)``."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = key.shape[1] != query.shape[1]
    if (not grouped or query.device.type != "cpu" or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(query.shape[2] > 1 and attention_mask is None and causal)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def group_attention(model: Any) -> bool:
    """Switch ``model`` (a transformers ``PreTrainedModel``) to ``GROUPED_SDPA`` when its attention is ``sdpa`` and
    grouped (fewer key / value heads than query heads); returns whether it did. Other models are left as they are."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or kv_heads == heads:
        return False
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the masks sdpa gets (else: none at all)
    model.set_attn_implementation(GROUPED_SDPA)
    return True


def contiguous_head(module: Any) -> Any:
    """Give the output head of ``module`` a densely laid-out input (a forward pre-hook, registered once; returns
    ``module``).

    A prefill asks for the last position's logits only (``logits_to_keep=1``), so the head gets the strided view
    ``hidden[:, -1:, :]``. torch 2.13's CPU ``matmul`` does not fold such a 3-D input into one matrix product when
    nothing requires grad (a generating copy, a frozen head): it runs a batched product over a copy of the transposed
    weight broadcast to the batch, hundreds of times slower on SmolLM2's [49152, 576] head (docs/results.md, "The
    strided LM-head input"). Copying the [B, 1, H] view is exact and costs microseconds.
    """
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if head is not None and not getattr(head, "_sara_dense_input", False):
        head.register_forward_pre_hook(_dense_args)
        head._sara_dense_input = True
    return module


def _dense_args(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_dense(a) for a in args)


def _dense(x: Any) -> Any:
    """``x`` with the row-major strides of its shape (a copy only when its strides differ, size-1 dimensions included:
    ``Tensor.contiguous`` keeps a [1, 1, H] view's odd leading stride)."""
    import torch

    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        return x
    want, acc = [], 1
    for size in reversed(x.shape):
        want.append(acc)
        acc *= int(size)
    return x if tuple(x.stride()) == tuple(reversed(want)) else x.clone(memory_format=torch.contiguous_format)
