"""RL algorithms (torch): advantage estimators, losses and algorithm specs.

- ``ADVANTAGES``: advantage estimators by name, one signature ``fn(AdvantageInputs, **params) -> (adv, returns)``,
  ``outcome_level=True`` at registration for estimators that read only the scalar rewards; the pure functions
  (``sara.algos.estimators``: ``grpo_advantages``, ``rloo_advantages``, ...) work on flat tensors and group ids, on
  the masked / grouped helpers of ``sara.algos.tensors``.
- ``sara.algos.losses``: PPO-clip policy loss (verl aggregation modes, dual clip, dead-group dropping), clipped value
  loss, KL (k1/k2/k3), entropy; ``rl_loss`` combines them.
- ``ALGOS``: ``AlgoSpec`` per algorithm (grpo, dr_grpo, rloo, ppo, reinforce_pp, reinforce_pp_baseline);
  ``make_algo("ppo:lam=0.95")`` (a validated pydantic model: a bad option raises ``ConfigError`` naming it); the
  trainer reads ``needs_critic`` / ``needs_reference`` / ``needs_entropy`` / ``epochs`` and calls
  ``spec.compute_advantages`` and ``spec.compute_loss`` only.

See docs/algorithms.md.
"""

from __future__ import annotations

from sara.algos.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    broadcast_to_tokens,
    build_token_rewards,
    gae_advantages,
    group_index,
    grpo_advantages,
    last_token_index,
    masked_mean,
    masked_var,
    masked_whiten,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)
from sara.algos.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    LossDenominators,
    LossInputs,
    active_mask,
    agg_loss,
    entropy_bonus,
    kl_loss,
    kl_penalty,
    loss_denominator,
    loss_denominators,
    policy_loss,
    rl_loss,
    value_loss,
)
from sara.algos.specs import ALGOS, AlgoSpec, make_algo, register_algo

__all__ = [
    "ADVANTAGES",
    "ALGOS",
    "AdvantageInputs",
    "AlgoSpec",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LossDenominators",
    "LossInputs",
    "active_mask",
    "agg_loss",
    "broadcast_to_tokens",
    "build_token_rewards",
    "entropy_bonus",
    "gae_advantages",
    "group_index",
    "grpo_advantages",
    "kl_loss",
    "kl_penalty",
    "last_token_index",
    "loss_denominator",
    "loss_denominators",
    "make_algo",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "register_algo",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "rl_loss",
    "rloo_advantages",
    "value_loss",
]
