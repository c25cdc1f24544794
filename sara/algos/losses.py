"""Policy-gradient losses over padded token batches (torch), with verl's aggregation semantics.

All tensors are ``[N, T]`` (N sequences, T response positions) with ``response_mask [N, T]`` 1 on tokens that count.
Every loss returns ``(scalar loss, metrics)`` where ``metrics`` maps ``"algo/..."`` keys to Python floats (detached),
ready for the trainer's flat metrics dict.

Aggregation (``agg_loss``, the modes of ``LOSS_AGG_MODES``, the denominators of gradient accumulation:
``loss_denominators``) lives in ``sara.algos.aggregate`` and is re-exported here.

Dead groups (TRL #6367): a group whose advantages are all exactly 0 (saturated under GRPO/RLOO) contributes nothing to
the policy-gradient numerator but still counts in the denominator, so the effective step size shrinks with the
fraction of saturated groups. ``drop_zero_adv=True`` removes such groups (or, without ``group_ids``, such sequences)
from the policy-gradient denominator; KL and entropy terms keep the full mask (they do carry gradient there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sara.algos.aggregate import (
    LOSS_AGG_MODES,
    LossDenominators,
    active_mask,
    agg_loss,
    loss_denominator,
    loss_denominators,
)
from sara.algos.tensors import masked_mean

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LossDenominators",
    "LossInputs",
    "active_mask",
    "agg_loss",
    "entropy_bonus",
    "kl_loss",
    "kl_penalty",
    "loss_denominator",
    "loss_denominators",
    "policy_loss",
    "rl_loss",
    "value_loss",
]

KL_ESTIMATORS = ("k1", "k2", "k3")
_LOG_RATIO_CLAMP = 20.0


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from samples of π (Schulman's estimators).

    With ``x = log π − log π_ref``: ``k1 = x`` (unbiased, can be negative), ``k2 = x²/2``,
    ``k3 = exp(−x) − 1 + x`` (unbiased, always ≥ 0; verl's "low_var_kl": ``x`` clamped to ±20, result to ≤ 10).

    Args:
        logprobs, ref_logprobs: ``[N, T]``.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        ``[N, T]`` (unmasked).
    """
    x = logprobs - ref_logprobs
    if estimator == "k1":
        return x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        x = x.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (torch.exp(-x) - 1 + x).clamp(max=10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg_mode: str = "token-mean",
    norm_len: float | None = None,
    drop_zero_adv: bool = False,
    group_ids: Tensor | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip policy loss ``max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))``, optionally dual-clipped.

    With ``dual_clip_c = c > 1`` the loss of negative-advantage tokens is additionally capped at ``−A·c`` (so a huge
    ratio on a bad token cannot blow up the update). ``ρ = exp(log π − log π_old)`` with the log-ratio clamped to ±20.

    Args:
        logprobs: ``[N, T]`` current log-probs (with gradient). old_logprobs: ``[N, T]`` rollout-time log-probs.
        advantages: ``[N, T]``. response_mask: ``[N, T]``.
        clip_ratio_low, clip_ratio_high: ε_low, ε_high (DAPO's clip-higher uses a larger ε_high).
        dual_clip_c: the dual-clip constant, ``None`` to disable.
        agg_mode, norm_len, denominator: see ``agg_loss``.
        drop_zero_adv: drop dead (all-zero-advantage) groups from the denominator (see the module docstring).
        group_ids: ``[N]`` for ``drop_zero_adv`` at group level (else per sequence).

    Returns:
        ``(loss, metrics)``; metrics: ``algo/pg_loss``, ``algo/pg_clipfrac`` (tokens where the clip is active),
        ``algo/pg_clipfrac_lower`` (dual clip active), ``algo/ppo_kl`` (mean of log π_old − log π),
        ``algo/approx_kl`` (k3 of the same), ``algo/ratio_max``, ``algo/active_token_frac`` (valid tokens of live
        groups / valid tokens).
    """
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError(f"clip ratios must be >= 0, got low={clip_ratio_low}, high={clip_ratio_high}")
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    token_loss = clipped
    valid = response_mask.to(torch.bool)
    dual_active = torch.zeros_like(valid)
    if dual_clip_c is not None:
        loss3 = -advantages * dual_clip_c
        neg = advantages < 0
        dual_active = neg & (clipped > loss3)
        token_loss = torch.where(neg, torch.minimum(clipped, loss3), clipped)
    live = active_mask(advantages, response_mask, group_ids) if drop_zero_adv else valid
    loss = agg_loss(token_loss, live, agg_mode, norm_len=norm_len, denominator=denominator)
    with torch.no_grad():
        vf = valid.to(ratio.dtype)
        n_valid = max(float(vf.sum()), 1.0)
        metrics = {
            "algo/pg_loss": float(loss.detach()),
            "algo/pg_clipfrac": float(((loss2 > loss1) & valid).sum()) / n_valid,
            "algo/pg_clipfrac_lower": float((dual_active & valid).sum()) / n_valid,
            "algo/ppo_kl": float(masked_mean(-log_ratio, valid)),
            "algo/approx_kl": float(masked_mean(torch.exp(-log_ratio) - 1 + log_ratio, valid)),
            "algo/ratio_max": float(ratio[valid].max()) if valid.any() else 1.0,
            "algo/active_token_frac": float(active_mask(advantages, response_mask, group_ids).sum())
            / n_valid,
        }
    return loss, metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip_range: float | None = 0.5,
    agg_mode: str = "token-mean",
    norm_len: float | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss ``½·max((V − R)², (clip(V, V_old ± c) − R)²)`` (verl semantics).

    Args:
        values: ``[N, T]`` current value predictions (with gradient). old_values: ``[N, T]`` rollout-time values.
        returns: ``[N, T]`` targets (``gae_advantages``' returns). response_mask: ``[N, T]``.
        clip_range: ``c``; ``None`` disables clipping.

    Returns:
        ``(loss, metrics)`` with ``algo/vf_loss``, ``algo/vf_clipfrac``, ``algo/vf_explained_var``.
    """
    err1 = (values - returns).square()
    if clip_range is None:
        token_loss = err1
        err2 = err1
    else:
        clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        err2 = (clipped - returns).square()
        token_loss = torch.maximum(err1, err2)
    loss = 0.5 * agg_loss(token_loss, response_mask, agg_mode, norm_len=norm_len, denominator=denominator)
    with torch.no_grad():
        valid = response_mask.to(torch.bool)
        ret = returns[valid].double()
        resid = (returns - values)[valid].double()
        var_ret = float(ret.var()) if ret.numel() > 1 else 0.0
        explained = 1.0 - float(resid.var()) / var_ret if var_ret > 0 and resid.numel() > 1 else 0.0
        metrics = {
            "algo/vf_loss": float(loss.detach()),
            "algo/vf_clipfrac": float(masked_mean((err2 > err1).to(values.dtype), valid)),
            "algo/vf_explained_var": explained,
        }
    return loss, metrics


def kl_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    *,
    estimator: str = "k3",
    agg_mode: str = "token-mean",
    norm_len: float | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """KL-to-reference loss term: ``agg_loss(kl_penalty(logprobs, ref_logprobs, estimator))``.

    Returns:
        ``(loss, {"algo/kl": value})`` (the caller multiplies by β).
    """
    kl = kl_penalty(logprobs, ref_logprobs, estimator)
    loss = agg_loss(kl, response_mask, agg_mode, norm_len=norm_len, denominator=denominator)
    return loss, {"algo/kl": float(loss.detach())}


def entropy_bonus(
    entropy: Tensor,
    response_mask: Tensor,
    *,
    agg_mode: str = "token-mean",
    norm_len: float | None = None,
    denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Aggregated token entropy (the caller subtracts ``entropy_coef ×`` this from the loss).

    Returns:
        ``(entropy, {"algo/entropy": value})``.
    """
    ent = agg_loss(entropy, response_mask, agg_mode, norm_len=norm_len, denominator=denominator)
    return ent, {"algo/entropy": float(ent.detach())}


@dataclass
class LossInputs:
    """Per-minibatch tensors for ``rl_loss`` (all ``[N, T]`` except ``group_ids [N]``).

    Attributes:
        logprobs: current policy log-probs of the response tokens (with gradient).
        advantages: from ``AlgoSpec.compute_advantages``.
        response_mask: 1 on tokens that count.
        old_logprobs: rollout-time log-probs; ``None`` means on-policy (``logprobs.detach()``, ratio 1).
        ref_logprobs: reference-policy log-probs (needed when the spec puts KL in the loss).
        entropy: per-token entropy (needed when ``entropy_coef > 0``; always reported when given).
        values: current value predictions (with gradient; needed when the spec has a critic).
        old_values: rollout-time value predictions (the ``values`` given to ``compute_advantages``).
        returns: value targets from ``compute_advantages``.
        group_ids: for ``drop_zero_adv_groups`` at group level.
    """

    logprobs: Tensor
    advantages: Tensor
    response_mask: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    entropy: Tensor | None = None
    values: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None
    group_ids: Tensor | None = None


def rl_loss(
    inputs: LossInputs,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    dual_clip_c: float | None = None,
    agg_mode: str = "token-mean",
    norm_len: float | None = None,
    drop_zero_adv: bool = False,
    kl_loss_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    critic: bool = False,
    vf_coef: float = 0.5,
    value_clip: float | None = 0.5,
    denominators: LossDenominators | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The whole objective: ``pg + β·KL − c_H·H + c_V·value loss`` (terms with a zero coefficient are skipped).

    Args:
        inputs: the minibatch (see ``LossInputs``).
        denominators: the whole mini-batch's counts when ``inputs`` is one micro-batch of it (``loss_denominators``);
            None = this batch's own.
        kl_loss_coef: β of the KL-in-loss term (needs ``inputs.ref_logprobs`` when > 0).
        critic: include the value loss (needs ``values``, ``old_values``, ``returns``).
        others: see ``policy_loss`` and ``value_loss``.

    Returns:
        ``(loss, metrics)``, metrics including ``algo/loss``.
    """
    old = inputs.old_logprobs if inputs.old_logprobs is not None else inputs.logprobs.detach()
    loss, metrics = policy_loss(
        inputs.logprobs,
        old,
        inputs.advantages,
        inputs.response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        dual_clip_c=dual_clip_c,
        agg_mode=agg_mode,
        norm_len=norm_len,
        drop_zero_adv=drop_zero_adv,
        group_ids=inputs.group_ids,
        denominator=None if denominators is None else denominators.policy,
    )
    other = None if denominators is None else denominators.other
    if kl_loss_coef > 0 and inputs.ref_logprobs is None:
        raise ValueError("KL in the loss needs LossInputs.ref_logprobs (log-probs of the reference policy)")
    if inputs.ref_logprobs is not None:  # reported whenever available (KL-in-reward specs too)
        kl, m = kl_loss(
            inputs.logprobs, inputs.ref_logprobs, inputs.response_mask, estimator=kl_estimator, agg_mode=agg_mode,
            norm_len=norm_len, denominator=other,
        )  # fmt: skip
        if kl_loss_coef > 0:
            loss = loss + kl_loss_coef * kl
        metrics.update(m)
    if inputs.entropy is not None:
        ent, m = entropy_bonus(inputs.entropy, inputs.response_mask, agg_mode=agg_mode, norm_len=norm_len,
                               denominator=other)
        metrics.update(m)
        if entropy_coef > 0:
            loss = loss - entropy_coef * ent
    elif entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs LossInputs.entropy (per-token entropy from the policy)")
    if critic:
        missing = [n for n in ("values", "old_values", "returns") if getattr(inputs, n) is None]
        if missing:
            raise ValueError(f"the value loss needs LossInputs.{', '.join(missing)}")
        vf, m = value_loss(
            inputs.values, inputs.old_values, inputs.returns, inputs.response_mask,  # type: ignore[arg-type]
            clip_range=value_clip, agg_mode=agg_mode, norm_len=norm_len, denominator=other,
        )  # fmt: skip
        loss = loss + vf_coef * vf
        metrics.update(m)
    metrics["algo/loss"] = float(loss.detach())
    return loss, metrics
