"""How per-token losses become a scalar: the aggregation modes, their denominators, and the live-group mask.

All tensors are ``[N, T]`` (N sequences, T response positions) with a mask ``[N, T]`` 1 on tokens that count.

Aggregation modes (``agg_loss``):

- ``"token-mean"``: sum over all valid tokens / number of valid tokens (DAPO; every token weighs the same).
- ``"seq-mean-token-mean"``: per-sequence mean over its valid tokens, then mean over sequences (original GRPO).
- ``"seq-mean-token-sum"``: per-sequence sum over its valid tokens, then mean over sequences.
- ``"seq-mean-token-sum-norm"``: per-sequence sum / a constant length (``norm_len``, default ``T``), then mean over
  sequences (Dr.GRPO's paper; verl's version of this mode sums over sequences instead of averaging them, which makes
  the scale grow with the batch size).

Sequences with no valid token are not counted in the seq-mean modes. ``denominator=`` overrides the count (tokens or
sequences) for gradient accumulation over micro-batches: ``loss_denominators`` counts once over the whole mini-batch,
and ``sara.algos.losses.rl_loss(denominators=...)`` divides every micro-batch's terms by those counts, so the
micro-batches' summed gradients equal one forward's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sara.algos.tensors import group_index

__all__ = ["LOSS_AGG_MODES", "LossDenominators", "active_mask", "agg_loss", "loss_denominator", "loss_denominators"]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")


def loss_denominator(mask: Tensor, mode: str) -> float:
    """What ``agg_loss`` divides by for ``mask``: valid tokens (token-mean) or sequences with a valid token."""
    _check_mode(mode)
    m = mask.to(torch.bool)
    if mode == "token-mean":
        return float(m.sum())
    return float(m.any(dim=-1).sum())


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    norm_len: float | None = None,
    denominator: float | None = None,
) -> Tensor:
    """Aggregate a per-token loss ``[N, T]`` to a scalar (see the module docstring for the modes).

    Args:
        loss_mat: ``[N, T]``. mask: ``[N, T]`` bool or 0/1.
        mode: one of ``LOSS_AGG_MODES``.
        norm_len: the constant length of ``"seq-mean-token-sum-norm"`` (default ``T``).
        denominator: overrides the token / sequence count (for gradient accumulation); ``None`` uses this batch's.

    Returns:
        A scalar tensor; 0 (with a gradient path) when nothing is valid.
    """
    _check_mode(mode)
    m = mask.to(loss_mat.dtype)
    seq_tokens = m.sum(dim=-1)
    count = denominator if denominator is not None else loss_denominator(mask, mode)
    count = max(count, 1.0)
    if mode == "token-mean":
        return (loss_mat * m).sum() / count
    seq_sum = (loss_mat * m).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq_loss = seq_sum / seq_tokens.clamp_min(1)
    elif mode == "seq-mean-token-sum":
        seq_loss = seq_sum
    else:
        seq_loss = seq_sum / float(norm_len if norm_len is not None else loss_mat.shape[-1])
    return seq_loss.sum() / count  # rows without valid tokens contribute 0 and are not counted


def active_mask(advantages: Tensor, response_mask: Tensor, group_ids: Tensor | None = None) -> Tensor:
    """``response_mask`` restricted to sequences whose group has some non-zero advantage.

    Args:
        advantages: ``[N, T]``. response_mask: ``[N, T]``.
        group_ids: ``[N]``; if ``None`` each sequence is judged on its own.

    Returns:
        bool ``[N, T]``: valid tokens of live groups (a mixed group with one exactly-zero member stays whole).
    """
    valid = response_mask.to(torch.bool)
    seq_live = ((advantages != 0) & valid).any(dim=-1)
    if group_ids is not None:
        inverse, counts = group_index(group_ids)
        live = torch.zeros(counts.numel(), dtype=torch.long, device=advantages.device)
        live = live.index_add(0, inverse, seq_live.long())
        seq_live = (live > 0)[inverse]
    return valid & seq_live[:, None]


@dataclass(frozen=True)
class LossDenominators:
    """What a mini-batch's loss terms divide by, counted once over the whole mini-batch (``loss_denominators``).

    Attributes:
        policy: The policy-gradient term's count (valid tokens or sequences of live groups under ``drop_zero_adv``).
        other: The KL, entropy and value terms' count (valid tokens or sequences of ``response_mask``).
    """

    policy: float
    other: float


def loss_denominators(advantages: Tensor, response_mask: Tensor, mode: str = "token-mean", *,
                      drop_zero_adv: bool = False, group_ids: Tensor | None = None) -> LossDenominators:
    """The counts ``rl_loss`` divides by on this (mini-)batch, for gradient accumulation over its micro-batches.

    A micro-batch's loss with these denominators is its share of the mini-batch's loss, so the summed gradients equal
    one forward's. (Dead rows, zero advantage, add nothing to the policy-gradient numerator wherever they land.)

    Args:
        advantages, response_mask: ``[N, T]`` of the whole mini-batch. mode: one of ``LOSS_AGG_MODES``.
        drop_zero_adv, group_ids: as in ``policy_loss``.
    """
    live = active_mask(advantages, response_mask, group_ids) if drop_zero_adv else response_mask
    return LossDenominators(policy=loss_denominator(live, mode), other=loss_denominator(response_mask, mode))
