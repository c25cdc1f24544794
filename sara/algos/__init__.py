"""RL algorithms: advantage estimators, losses and algorithm specs (torch).

``ADVANTAGES`` registers advantage estimators under one signature (see ``sara.algos.advantages``).
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
    masked_mean,
    masked_var,
    masked_whiten,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)

__all__ = [
    "ADVANTAGES",
    "AdvantageInputs",
    "broadcast_to_tokens",
    "build_token_rewards",
    "gae_advantages",
    "group_index",
    "grpo_advantages",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "reinforce_pp_baseline_advantages",
    "reinforce_pp_returns",
    "rloo_advantages",
]
