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
``sara.algos.specs.AlgoSpec`` calls, so the trainer never branches on names. The keyword-only ``params`` are the
estimator's options (``make_algo("ppo:lam=0.95")``), validated by their annotations (``Annotated[float, Field(...)]``
ranges); ``outcome_level=True`` at registration marks an estimator that reads only the scalar rewards.

Layout: ``sara.algos.tensors`` (masked / grouped tensor helpers), ``sara.algos.estimators`` (the pure functions),
this module (``AdvantageInputs``, the ``ADVANTAGES`` registry and its adapters; it re-exports the other two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, runtime_checkable

from pydantic import Field
from torch import Tensor

from sara.algos.estimators import (
    gae_advantages,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)
from sara.algos.options import EstimatorParams, estimator_params_model
from sara.algos.tensors import (
    WHITEN_EPS,
    broadcast_to_tokens,
    build_token_rewards,
    group_index,
    last_token_index,
    masked_mean,
    masked_var,
    masked_whiten,
)
from sara.registry import Registry, takes

__all__ = [
    "ADVANTAGES",
    "AdvantageFn",
    "AdvantageInputs",
    "AdvantageRegistry",
    "EstimatorParams",
    "OutcomeLevelFlag",
    "WHITEN_EPS",
    "broadcast_to_tokens",
    "build_token_rewards",
    "estimator_params_model",
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


# ------------------------------------------------------------------------------------------------------------ inputs
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


# ---------------------------------------------------------------------------------------------------------- registry
@runtime_checkable
class OutcomeLevelFlag(Protocol):
    """An estimator function that says itself whether it is outcome-level (``fn.outcome_level = True``): how a
    ``"module:attr"`` estimator that is not registered carries the flag."""

    outcome_level: bool


class AdvantageRegistry(Registry[AdvantageFn]):
    """The ``Registry`` of advantage estimators, plus a per-estimator ``outcome_level`` flag.

    An *outcome-level* estimator reads only the scalar ``rewards`` and ``group_ids``, never ``token_level_rewards``,
    so a KL penalty folded into the token rewards (``kl_mode="reward"``) would be silently ignored by it;
    ``AlgoSpec`` rejects that combination for every estimator flagged here. Register yours with
    ``ADVANTAGES.register("mine", fn, outcome_level=True)`` (or as a decorator); a ``"module:attr"`` estimator that
    is not registered can carry the flag as a function attribute ``fn.outcome_level = True`` (``OutcomeLevelFlag``).
    """

    def __init__(self, kind: str) -> None:
        super().__init__(kind, accepts=takes(AdvantageInputs),
                         expects="a function whose first parameter is annotated 'inputs: AdvantageInputs'")
        self._outcome_level: dict[str, bool] = {}

    def register(  # type: ignore[override]
        self,
        name: str,
        obj: AdvantageFn | str | None = None,
        *,
        override: bool = False,
        outcome_level: bool = False,
    ) -> Any:
        """Register ``obj`` under ``name`` (without ``obj``: a decorator); ``outcome_level`` as described above.

        Raises:
            ValueError: ``name`` is already registered and ``override`` is false.
        """
        if obj is None:

            def deco(fn: AdvantageFn) -> AdvantageFn:
                self.register(name, fn, override=override, outcome_level=outcome_level)
                return fn

            return deco
        out = super().register(name, obj, override=override)
        self._outcome_level[name] = bool(outcome_level)
        return out

    def is_outcome_level(self, name: str) -> bool:
        """Whether estimator ``name`` reads only the scalar rewards (registration flag or ``fn.outcome_level``).

        Raises:
            KeyError: unknown estimator.
        """
        if self._outcome_level.get(name, False):
            return True
        fn = self.get(name)
        return isinstance(fn, OutcomeLevelFlag) and bool(fn.outcome_level)

    def outcome_level_names(self) -> frozenset[str]:
        """Registered estimators flagged outcome-level."""
        return frozenset(n for n in self.names() if self.is_outcome_level(n))

    def params_model(self, name: str) -> type[EstimatorParams]:
        """The options model of estimator ``name`` (see ``estimator_params_model``).

        Raises:
            KeyError: unknown estimator.
        """
        return estimator_params_model(self.get(name))


ADVANTAGES = AdvantageRegistry("advantage estimator")

Discount = Annotated[float, Field(gt=0.0, le=1.0, description="discount γ per token, in (0, 1]")]
GaeLambda = Annotated[
    float, Field(ge=0.0, le=1.0, description="GAE λ in [0, 1] (0: one-step TD, 1: Monte Carlo)")
]
StdEps = Annotated[float, Field(ge=0.0, description="added to the group std (>= 0)")]


# ------------------------------------------------------------------------------------------ uniform registry adapters
@ADVANTAGES.register("grpo", outcome_level=True)
def _grpo(inputs: AdvantageInputs, *, eps: StdEps = 1e-6, normalize_std: bool = True) -> tuple[Tensor, None]:
    """GRPO (``normalize_std=True``) / Dr.GRPO (``False``), tiled over tokens. Uses rewards, group_ids, mask."""
    adv = grpo_advantages(inputs.rewards, inputs.group_ids, eps=eps, normalize_std=normalize_std)
    return broadcast_to_tokens(adv, inputs.response_mask), None


@ADVANTAGES.register("dr_grpo", outcome_level=True)
def _dr_grpo(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    """Dr.GRPO: ``r − mean_g`` tiled over tokens. Uses rewards, group_ids, mask."""
    return _grpo(inputs, normalize_std=False)


@ADVANTAGES.register("rloo", outcome_level=True)
def _rloo(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    """RLOO, tiled over tokens. Uses rewards, group_ids, mask."""
    return broadcast_to_tokens(rloo_advantages(inputs.rewards, inputs.group_ids), inputs.response_mask), None


@ADVANTAGES.register("reinforce_pp_baseline", outcome_level=True)
def _reinforce_pp_baseline(inputs: AdvantageInputs) -> tuple[Tensor, None]:
    """REINFORCE++-baseline. Uses rewards, group_ids, mask."""
    return reinforce_pp_baseline_advantages(inputs.rewards, inputs.group_ids, inputs.response_mask), None


@ADVANTAGES.register("reinforce_pp")
def _reinforce_pp(inputs: AdvantageInputs, *, gamma: Discount = 1.0) -> tuple[Tensor, None]:
    """REINFORCE++ (whitened return-to-go). Uses token rewards (or rewards) and mask; no value target."""
    adv, _ = reinforce_pp_returns(inputs.token_rewards(), inputs.response_mask, gamma=gamma)
    return adv, None


@ADVANTAGES.register("gae")
def _gae(inputs: AdvantageInputs, *, gamma: Discount = 1.0, lam: GaeLambda = 1.0) -> tuple[Tensor, Tensor]:
    """GAE for PPO. Uses token rewards (or rewards), values and mask; returns the value target."""
    if inputs.values is None:
        raise ValueError("gae advantages need AdvantageInputs.values [N, T] from the policy's value head")
    return gae_advantages(inputs.token_rewards(), inputs.values, inputs.response_mask, gamma=gamma, lam=lam)
