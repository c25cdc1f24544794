"""Token log-probs and entropies over the vocabulary in bounded memory (the learner's vocabulary projection).

``token_logprobs`` applies the LM head to hidden states ``h [K, D]`` a chunk of ``C`` rows at a time and returns, per
row, the log-prob of its target token (and the entropy when asked). Each chunk runs under non-reentrant activation
checkpointing (``torch.utils.checkpoint``): the autograd graph keeps the chunk's slice of ``h`` and its targets, not
its logits, and the backward recomputes one chunk's ``[C, V]`` logits at a time. No ``[K, V]`` tensor exists in the
forward or the backward; the largest logits-shaped tensors are one chunk's ``[C, V]``.

With a compute ``dtype`` (bfloat16 under the policy's autocast) the head's weight is cast once per call, not once per
chunk and again in each chunk's recomputation as autocast would (for SmolLM2 a ``[49152, 576]`` copy each); every
chunk reads that one copy, and its weight gradient reaches the float32 weight chunk by chunk, converted and
accumulated in float32 as under autocast (``_SharedCast``): the same numbers. A head that is not a plain
``nn.Linear`` (its own ``forward``) runs as it is, under autocast, per chunk.

Shapes: ``K`` rows (scored positions), ``D`` hidden size, ``V`` vocabulary size, ``C`` rows per chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["CHUNK_BYTES", "chunk_rows", "token_logprobs"]

CHUNK_BYTES = 1 << 25
"""Bytes of one chunk's float32 logits ``[C, V]`` that ``chunk_rows`` sizes a chunk to (at least one row)."""


def chunk_rows(vocab: int, nbytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk whose float32 logits over ``vocab`` columns take at most ``nbytes`` (at least 1)."""
    return max(1, nbytes // (4 * vocab))


class _SharedCast(torch.autograd.Function):
    """``cast`` (a copy of ``weight`` in another dtype, made once) as a differentiable function of ``weight``: the
    forward returns a view of the copy, the backward the gradient converted to ``weight``'s dtype."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def token_logprobs(h: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                   finish: Callable[[torch.Tensor], torch.Tensor], *, dtype: torch.dtype | None = None,
                   with_entropy: bool = False, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[K]`` of ``targets`` under ``finish(head(h).float())``, and the entropies ``[K]`` when asked.

    Args:
        h: Hidden states ``[K, D]``.
        targets: Token ids ``[K]``, one per row of ``h``.
        head: The LM head, a linear map ``[n, D] -> [n, V]`` (its ``weight [V, D]``, and ``bias [V]`` if it has one).
        finish: Float32 post-processing of the head's output (soft cap, temperature).
        dtype: The head matmul's dtype, as autocast runs it (the hidden states and the weight cast to it; None: the
            weight's own dtype, nothing cast).
        with_entropy: Also return the entropy of each row's distribution.
        chunk: Rows per chunk (default ``chunk_rows(V)``, ``V`` the head's output width).

    Returns:
        ``(logprobs, entropy)``, float32, each ``[K]``; ``entropy`` is None unless ``with_entropy``.
    """
    if chunk is None:
        chunk = chunk_rows(_vocab_size(head))
    if chunk < 1:
        raise ValueError(f"token_logprobs: chunk must be at least 1, got {chunk}")
    weight, bias = getattr(head, "weight", None), getattr(head, "bias", None)
    plain = type(head).forward is torch.nn.Linear.forward  # a linear map, run here as F.linear on one cast copy
    copies = {id(p): p.detach().to(dtype) for p in (weight, bias)
              if plain and isinstance(p, torch.Tensor) and dtype is not None and p.dtype != dtype}

    def param(p: torch.Tensor) -> torch.Tensor:
        return _SharedCast.apply(p, copies[id(p)]) if id(p) in copies else p

    def project(hc: torch.Tensor) -> torch.Tensor:
        if plain:
            return torch.nn.functional.linear(hc if dtype is None else hc.to(dtype), param(weight),
                                              None if bias is None else param(bias))
        with torch.autocast(hc.device.type, dtype=dtype, enabled=dtype is not None):  # another head: as it is
            return cast(torch.Tensor, head(hc))

    def rows(hc: torch.Tensor, tc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = project(hc)
        logits = finish(out.float())  # [C, V]
        logz = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, tc[:, None]).squeeze(-1) - logz
        ent = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1) if with_entropy else None
        return lp, ent

    recompute = torch.is_grad_enabled()  # without a graph there is nothing to keep: run the chunks as they are
    parts = [checkpoint(rows, hc, tc, use_reentrant=False, preserve_rng_state=False) if recompute else rows(hc, tc)
             for hc, tc in zip(h.split(chunk), targets.split(chunk), strict=True)]
    lp = torch.cat([p[0] for p in parts])
    ent = torch.cat([p[1] for p in parts if p[1] is not None]) if with_entropy else None
    return lp, ent


def _vocab_size(head: torch.nn.Module) -> int:
    """The output width of ``head`` (the first dimension of its ``weight``, as in an ``nn.Linear``)."""
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError("token_logprobs: head has no weight to size a chunk by; pass chunk")
    return int(weight.shape[0])
