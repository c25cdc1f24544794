"""Masked and grouped tensor helpers shared by the advantage estimators and the losses (torch).

Conventions: ``N`` rollouts, ``T`` response positions; ``group_ids [N]`` any integers (found with
``torch.unique(return_inverse=True)`` and reduced with ``index_add`` / ``scatter_reduce``, never reshaped to
``[G, k]``); ``response_mask [N, T]`` 1 (or True) on tokens that count. Statistics run in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "WHITEN_EPS",
    "broadcast_to_tokens",
    "build_token_rewards",
    "group_index",
    "last_token_index",
    "masked_mean",
    "masked_var",
    "masked_whiten",
]

WHITEN_EPS = 1e-8


def out_dtype(x: Tensor) -> torch.dtype:
    """The dtype an estimator returns for input ``x``: its own when floating, else torch's default."""
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


def check_flat(rewards: Tensor, group_ids: Tensor) -> None:
    """Raise ``ValueError`` unless ``rewards`` is ``[N]`` and ``group_ids`` integer ``[N]``."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have the shape of rewards {tuple(rewards.shape)}, got {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}")


def check_tokens(x: Tensor, response_mask: Tensor, what: str) -> None:
    """Raise ``ValueError`` unless ``response_mask`` is ``[N, T]`` and ``x`` (named ``what``) has its shape."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be 2-D [N, T], got shape {tuple(response_mask.shape)}")
    if x.shape != response_mask.shape:
        raise ValueError(
            f"{what} must have the shape of response_mask {tuple(response_mask.shape)}, got {tuple(x.shape)}"
        )


def group_index(group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Map arbitrary integer group ids to dense indices.

    Args:
        group_ids: ``[N]`` integers, any order, any values.

    Returns:
        ``(inverse [N] in 0..G-1, counts [G])`` with ``counts[g]`` the size of dense group ``g``.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return inverse, counts


def group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-rollout group statistics in float64.

    Returns:
        ``(r [N], mean_g [N], count_g [N], saturated [N] bool)`` where ``saturated`` means every reward of the
        rollout's group is exactly equal (this includes singletons).
    """
    inverse, counts = group_index(group_ids)
    r = rewards.to(torch.float64)
    num_groups = counts.numel()
    sums = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, r)
    mean = (sums / counts.to(torch.float64))[inverse]
    gmax = torch.full((num_groups,), -torch.inf, dtype=torch.float64, device=r.device)
    gmin = torch.full((num_groups,), torch.inf, dtype=torch.float64, device=r.device)
    gmax = gmax.scatter_reduce(0, inverse, r, reduce="amax")
    gmin = gmin.scatter_reduce(0, inverse, r, reduce="amin")
    # Exact equality of the rewards themselves (not a tolerance on a computed std): the mean of k equal floats can
    # differ from them by rounding, which would otherwise leak a tiny non-zero advantage into saturated groups.
    saturated = (gmax == gmin)[inverse]
    return r, mean, counts.to(torch.float64)[inverse], saturated


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is non-zero (0 where nothing is valid).

    Args:
        x: any shape. mask: same shape, bool or 0/1.
        dim: reduce over this dimension only; ``None`` reduces everything to a scalar.
    """
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over valid positions (scalar); unbiased (n−1) by default, 0 when fewer than 2 are valid."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp_min(1)
    var = (((x - mean) ** 2) * m).sum() / n.clamp_min(1)
    if unbiased:
        var = var * n / (n - 1).clamp_min(1)
    return var


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = WHITEN_EPS) -> Tensor:
    """verl's masked whitening: ``(x − mean) · rsqrt(var + eps)`` with mean / unbiased var over valid positions.

    Args:
        x: ``[N, T]``. mask: ``[N, T]``.
        shift_mean: if false, the mean is added back (only the scale changes).

    Returns:
        ``[N, T]``, exactly 0 where ``mask`` is 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(out.dtype)


def broadcast_to_tokens(seq_values: Tensor, response_mask: Tensor) -> Tensor:
    """Tile a per-rollout value over its response tokens.

    Args:
        seq_values: ``[N]``. response_mask: ``[N, T]``.

    Returns:
        ``[N, T]``: ``seq_values[i]`` on valid tokens of row ``i``, 0 elsewhere.
    """
    if seq_values.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != seq_values.shape[0]:
        raise ValueError(
            f"expected seq_values [N] and response_mask [N, T], got {tuple(seq_values.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    return seq_values[:, None] * response_mask.to(seq_values.dtype)


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index ``[N]`` of the last valid token of each row (0 for a row with no valid token)."""
    n, t_len = response_mask.shape
    if t_len == 0:
        return torch.zeros(n, dtype=torch.long, device=response_mask.device)
    t = torch.arange(t_len, device=response_mask.device)
    return (response_mask.to(torch.bool) * t).amax(dim=1)


def build_token_rewards(
    rewards: Tensor, response_mask: Tensor, *, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """Token-level rewards for REINFORCE++ / PPO: the scalar reward on the last valid token minus β·KL per token.

    Args:
        rewards: ``[N]`` scalar verifier rewards.
        response_mask: ``[N, T]``.
        kl: ``[N, T]`` per-token KL estimate to the reference policy (e.g. ``kl_penalty(old_logprobs,
            ref_logprobs, "k1")``), or ``None`` for no penalty.
        kl_coef: β.

    Returns:
        ``[N, T]`` float, 0 on masked positions. A row without any valid token gets no reward (it has no token to
        carry it; such a row contributes nothing to the loss either).
    """
    if rewards.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"expected rewards [N] and response_mask [N, T], got {tuple(rewards.shape)} and {tuple(response_mask.shape)}"
        )
    dtype = out_dtype(rewards)
    mask = response_mask.to(dtype)
    out = torch.zeros(response_mask.shape, dtype=dtype, device=rewards.device)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    has_token = response_mask.to(torch.bool).any(dim=1)
    if response_mask.shape[1]:
        out[rows, last_token_index(response_mask)] = rewards.to(dtype) * has_token.to(dtype)
    if kl is not None and kl_coef != 0.0:
        check_tokens(kl, response_mask, "kl")
        out = out - kl_coef * kl.to(dtype)
    return out * mask
