"""Advantage estimators as pure torch functions over flat per-rollout tensors and group ids.

Outcome-level (one advantage per rollout, ``[N]``; exactly 0 for singletons and saturated groups):
``grpo_advantages(rewards, group_ids)`` (Dr.GRPO with ``normalize_std=False``), ``rloo_advantages(rewards,
group_ids)``. Token-level (``[N, T]``, whitened over the batch's valid tokens, so saturated groups do NOT get zero
signal): ``reinforce_pp_baseline_advantages(rewards, group_ids, response_mask)``,
``reinforce_pp_returns(token_rewards, response_mask)``, ``gae_advantages(token_rewards, values, response_mask)``.
Shapes and conventions: see ``sara.algos.advantages``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sara.algos.tensors import (
    broadcast_to_tokens,
    check_flat,
    check_tokens,
    group_index,
    group_stats,
    masked_whiten,
    out_dtype,
)

__all__ = [
    "gae_advantages",
    "grpo_advantages",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
]


# ------------------------------------------------------------------------------------------- outcome-level (per rollout)
def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6, normalize_std: bool = True
) -> Tensor:
    """GRPO (and Dr.GRPO) advantages: ``(r − mean_g) / (std_g + eps)``, unbiased std (n−1).

    Args:
        rewards: ``[N]`` scalar rewards.
        group_ids: ``[N]`` integer group ids (arbitrary values and order; groups of any size ≥ 1).
        eps: added to the std.
        normalize_std: ``False`` gives Dr.GRPO: ``r − mean_g``.

    Returns:
        ``[N]`` advantages; exactly 0 for singletons and saturated groups (all rewards equal).
    """
    check_flat(rewards, group_ids)
    r, mean, count, saturated = group_stats(rewards, group_ids)
    centered = r - mean
    if normalize_std:
        inverse, counts = group_index(group_ids)
        sq = torch.zeros(counts.numel(), dtype=torch.float64, device=r.device).index_add_(
            0, inverse, centered**2
        )
        std = (sq / (counts.to(torch.float64) - 1).clamp_min(1)).sqrt()[inverse]
        centered = centered / (std + eps)
    adv = torch.where(saturated, torch.zeros_like(centered), centered)
    return adv.to(out_dtype(rewards))


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantages: ``r_i − mean of the other members = k/(k−1) · (r_i − mean_g)``.

    Args:
        rewards: ``[N]``. group_ids: ``[N]`` (any integers, groups of any size ≥ 1).

    Returns:
        ``[N]``; exactly 0 for singletons (no other member to form a baseline) and saturated groups.
    """
    check_flat(rewards, group_ids)
    r, mean, count, saturated = group_stats(rewards, group_ids)
    adv = count / (count - 1).clamp_min(1) * (r - mean)
    adv = torch.where(saturated, torch.zeros_like(adv), adv)
    return adv.to(out_dtype(rewards))


# ------------------------------------------------------------------------------------------------------- token-level
def reinforce_pp_baseline_advantages(rewards: Tensor, group_ids: Tensor, response_mask: Tensor) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, tile over response tokens, whiten over the batch's valid tokens.

    Args:
        rewards: ``[N]``. group_ids: ``[N]``. response_mask: ``[N, T]``.

    Returns:
        ``[N, T]`` advantages, ``(x − mean) · rsqrt(var + 1e-8)`` with mean / unbiased var over all valid tokens; 0 on
        masked positions. A singleton's centred score is 0 before whitening (verl keeps its raw reward). Saturated
        groups are 0 before whitening but generally NOT after it (whitening shifts by the batch mean).
    """
    check_flat(rewards, group_ids)
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"response_mask must be [N, T] with N={rewards.shape[0]}, got {tuple(response_mask.shape)}"
        )
    r, mean, _, saturated = group_stats(rewards, group_ids)
    centered = torch.where(saturated, torch.zeros_like(r), r - mean)
    scores = broadcast_to_tokens(centered, response_mask)
    return masked_whiten(scores, response_mask).to(out_dtype(rewards))


def reinforce_pp_returns(
    token_rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: return-to-go ``G_t = r_t + γ·G_{t+1}`` over valid tokens, whitened over the batch.

    The KL penalty is folded into ``token_rewards`` by the caller (see ``build_token_rewards``). Masked positions are
    skipped: they add no reward and do not break the chain (identical to verl for right-padded responses).

    Args:
        token_rewards: ``[N, T]``. response_mask: ``[N, T]``. gamma: discount.

    Returns:
        ``(advantages [N, T], returns [N, T])``: the whitened and the raw returns-to-go, both 0 on masked positions.
    """
    check_tokens(token_rewards, response_mask, "token_rewards")
    dtype = out_dtype(token_rewards)
    mask = response_mask.to(torch.float64)
    rew = token_rewards.to(torch.float64) * mask
    returns = torch.zeros_like(rew)
    running = torch.zeros(rew.shape[0], dtype=torch.float64, device=rew.device)
    for t in reversed(range(rew.shape[1])):
        m = mask[:, t]
        running = m * (rew[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    adv = masked_whiten(returns, response_mask)
    return adv.to(dtype), returns.to(dtype)


def gae_advantages(
    token_rewards: Tensor, values: Tensor, response_mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (PPO with a value head), over valid tokens only.

    ``δ_t = r_t + γ·V_{t'} − V_t`` and ``A_t = δ_t + γλ·A_{t'}`` where ``t'`` is the next *valid* position (masked
    positions are skipped: their values and TD errors do not enter; past the last valid token ``V = 0``, ``A = 0``).
    ``returns = A + V`` (the value-loss target); the advantages are then whitened over the batch's valid tokens.

    Args:
        token_rewards: ``[N, T]`` (see ``build_token_rewards``). values: ``[N, T]`` value estimates of the rollout
            policy. response_mask: ``[N, T]``. gamma, lam: discount and GAE λ.

    Returns:
        ``(advantages [N, T] whitened, returns [N, T])``, both 0 on masked positions.
    """
    check_tokens(token_rewards, response_mask, "token_rewards")
    check_tokens(values, response_mask, "values")
    dtype = out_dtype(token_rewards)
    mask = response_mask.to(torch.float64)
    rew = token_rewards.to(torch.float64)
    val = values.to(torch.float64)
    n, t_len = rew.shape
    adv = torch.zeros_like(rew)
    next_value = torch.zeros(n, dtype=torch.float64, device=rew.device)
    last_gae = torch.zeros(n, dtype=torch.float64, device=rew.device)
    for t in reversed(range(t_len)):
        m = mask[:, t]
        delta = rew[:, t] + gamma * next_value - val[:, t]
        gae_t = delta + gamma * lam * last_gae
        # on a masked position carry the previous (later) quantities through unchanged
        next_value = m * val[:, t] + (1 - m) * next_value
        last_gae = m * gae_t + (1 - m) * last_gae
        adv[:, t] = last_gae * m
    returns = (adv + val) * mask
    adv = masked_whiten(adv, response_mask)
    return adv.to(dtype), returns.to(dtype)
