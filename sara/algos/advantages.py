"""Advantage estimators: pure torch functions over flat per-rollout tensors and group ids.

Conventions (every function):

- ``N`` rollouts, ``T`` response positions. ``rewards [N]`` is the scalar verifier reward of each rollout,
  ``group_ids [N]`` any integers (not necessarily contiguous, sorted or equal-sized: groups are found with
  ``torch.unique(return_inverse=True)`` and reduced with ``index_add``; nothing is reshaped to ``[G, k]``).
  ``response_mask [N, T]`` is 1 (or True) on the tokens that count in the loss.
- Statistics are computed in float64 and returned in the reward dtype (float32 for integer rewards).
- Masked positions of every ``[N, T]`` output are exactly 0.

Outcome-level estimators (``grpo_advantages``, ``rloo_advantages``) return one advantage per rollout ``[N]``; use
``broadcast_to_tokens`` to get ``[N, T]``. A singleton group, and a *saturated* group (all rewards exactly equal, e.g.
all-0 or all-1), gets advantage exactly 0 under GRPO, Dr.GRPO and RLOO. verl gives a singleton its raw reward (it uses
mean 0, std 1); we deliberately do not: one sample carries no baseline, so it carries no signal.

Token-level estimators (``reinforce_pp_baseline_advantages``, ``reinforce_pp_returns``, ``gae_advantages``) whiten
over all valid tokens of the batch, so saturated groups do NOT get zero signal under them.

``ADVANTAGES`` registers one adapter per estimator with a single signature,
``fn(inputs: AdvantageInputs, **params) -> (advantages [N, T], returns [N, T] | None)``; that is what
``sara.algos.specs.AlgoSpec`` calls, so the trainer never branches on names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from sara.registry import Registry

__all__ = [
    "ADVANTAGES",
    "AdvantageFn",
    "AdvantageInputs",
    "broadcast_to_tokens",
    "build_token_rewards",
    "gae_advantages",
    "group_index",
    "grpo_advantages",
    "last_token_index",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
]

WHITEN_EPS = 1e-8


# ----------------------------------------------------------------------------------------------------------- helpers
def _out_dtype(x: Tensor) -> torch.dtype:
    return x.dtype if x.is_floating_point() else torch.get_default_dtype()


def _check_flat(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids must have the shape of rewards {tuple(rewards.shape)}, got {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point() or group_ids.is_complex():
        raise ValueError(f"group_ids must be integers, got dtype {group_ids.dtype}")


def _check_tokens(x: Tensor, response_mask: Tensor, what: str) -> None:
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


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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
    dtype = _out_dtype(rewards)
    mask = response_mask.to(dtype)
    out = torch.zeros(response_mask.shape, dtype=dtype, device=rewards.device)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    has_token = response_mask.to(torch.bool).any(dim=1)
    if response_mask.shape[1]:
        out[rows, last_token_index(response_mask)] = rewards.to(dtype) * has_token.to(dtype)
    if kl is not None and kl_coef != 0.0:
        _check_tokens(kl, response_mask, "kl")
        out = out - kl_coef * kl.to(dtype)
    return out * mask


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
    _check_flat(rewards, group_ids)
    r, mean, count, saturated = _group_stats(rewards, group_ids)
    centered = r - mean
    if normalize_std:
        inverse, counts = group_index(group_ids)
        sq = torch.zeros(counts.numel(), dtype=torch.float64, device=r.device).index_add_(
            0, inverse, centered**2
        )
        std = (sq / (counts.to(torch.float64) - 1).clamp_min(1)).sqrt()[inverse]
        centered = centered / (std + eps)
    adv = torch.where(saturated, torch.zeros_like(centered), centered)
    return adv.to(_out_dtype(rewards))


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantages: ``r_i − mean of the other members = k/(k−1) · (r_i − mean_g)``.

    Args:
        rewards: ``[N]``. group_ids: ``[N]`` (any integers, groups of any size ≥ 1).

    Returns:
        ``[N]``; exactly 0 for singletons (no other member to form a baseline) and saturated groups.
    """
    _check_flat(rewards, group_ids)
    r, mean, count, saturated = _group_stats(rewards, group_ids)
    adv = count / (count - 1).clamp_min(1) * (r - mean)
    adv = torch.where(saturated, torch.zeros_like(adv), adv)
    return adv.to(_out_dtype(rewards))


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
    _check_flat(rewards, group_ids)
    if response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"response_mask must be [N, T] with N={rewards.shape[0]}, got {tuple(response_mask.shape)}"
        )
    r, mean, _, saturated = _group_stats(rewards, group_ids)
    centered = torch.where(saturated, torch.zeros_like(r), r - mean)
    scores = broadcast_to_tokens(centered, response_mask)
    return masked_whiten(scores, response_mask).to(_out_dtype(rewards))


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
    _check_tokens(token_rewards, response_mask, "token_rewards")
    dtype = _out_dtype(token_rewards)
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
    _check_tokens(token_rewards, response_mask, "token_rewards")
    _check_tokens(values, response_mask, "values")
    dtype = _out_dtype(token_rewards)
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


# ------------------------------------------------------------------------------------------ uniform registry adapters
@dataclass
class AdvantageInputs:
    """Everything an advantage estimator may use (torch tensors; the trainer fills what the spec needs).

    Attributes:
        rewards: ``[N]`` scalar verifier rewards.
        group_ids: ``[N]`` integer group (prompt) ids, any values.
        response_mask: ``[N, T]`` 1 on response tokens that count in the loss.
        token_level_rewards: ``[N, T]`` per-token rewards (KL penalty folded in), or ``None`` to derive them from
            ``rewards`` (scalar on the last valid token).
        values: ``[N, T]`` value-head estimates at rollout time (PPO only).
        old_logprobs: ``[N, T]`` log-probs of the rollout policy (needed when KL is folded into the reward).
        ref_logprobs: ``[N, T]`` log-probs of the reference policy (ditto).
    """

    rewards: Tensor
    group_ids: Tensor
    response_mask: Tensor
    token_level_rewards: Tensor | None = None
    values: Tensor | None = None
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None

    def token_rewards(self) -> Tensor:
        """``token_level_rewards`` if given, else the scalar reward placed on the last valid token."""
        if self.token_level_rewards is not None:
            return self.token_level_rewards
        return build_token_rewards(self.rewards, self.response_mask)


AdvantageFn = Callable[..., tuple[Tensor, Tensor | None]]
"""``fn(inputs: AdvantageInputs, **params) -> (advantages [N, T], returns [N, T] | None)``."""

ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")


@ADVANTAGES.register("grpo")
def _grpo(inputs: AdvantageInputs, *, eps: float = 1e-6, normalize_std: bool = True) -> tuple[Tensor, None]:
    """GRPO (``normalize_std=True``) / Dr.GRPO (``False``), tiled over tokens. Uses rewards, group_ids, mask."""
    adv = grpo_advantages(inputs.rewards, inputs.group_ids, eps=eps, normalize_std=normalize_std)
    return broadcast_to_tokens(adv, inputs.response_mask), None


@ADVANTAGES.register("dr_grpo")
def _dr_grpo(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    """Dr.GRPO: ``r − mean_g`` tiled over tokens. Uses rewards, group_ids, mask."""
    return _grpo(inputs, normalize_std=False)


@ADVANTAGES.register("rloo")
def _rloo(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    """RLOO, tiled over tokens. Uses rewards, group_ids, mask."""
    return broadcast_to_tokens(rloo_advantages(inputs.rewards, inputs.group_ids), inputs.response_mask), None


@ADVANTAGES.register("reinforce_pp_baseline")
def _reinforce_pp_baseline(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    """REINFORCE++-baseline. Uses rewards, group_ids, mask."""
    return reinforce_pp_baseline_advantages(inputs.rewards, inputs.group_ids, inputs.response_mask), None


@ADVANTAGES.register("reinforce_pp")
def _reinforce_pp(inputs: AdvantageInputs, *, gamma: float = 1.0) -> tuple[Tensor, None]:
    """REINFORCE++ (whitened return-to-go). Uses token rewards (or rewards) and mask; no value target."""
    adv, _ = reinforce_pp_returns(inputs.token_rewards(), inputs.response_mask, gamma=gamma)
    return adv, None


@ADVANTAGES.register("gae")
def _gae(inputs: AdvantageInputs, *, gamma: float = 1.0, lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """GAE for PPO. Uses token rewards (or rewards), values and mask; returns the value target."""
    if inputs.values is None:
        raise ValueError("gae advantages need AdvantageInputs.values [N, T] from the policy's value head")
    return gae_advantages(inputs.token_rewards(), inputs.values, inputs.response_mask, gamma=gamma, lam=lam)
