"""Algorithm specs: everything the trainer needs to know about GRPO, Dr.GRPO, RLOO, PPO and REINFORCE++, as data.

The trainer calls the same two methods for every algorithm and never branches on its name::

    spec = make_algo("grpo")                        # or "ppo:lam=0.95,kl_coef=0.01", or ALGOS.get("rloo")
    if spec.needs_reference: ...                    # compute ref_logprobs with a frozen copy of the policy
    if spec.needs_critic: ...                       # compute values with the policy's value head
    adv, returns = spec.compute_advantages(AdvantageInputs(rewards, group_ids, response_mask, values=..., ...))
    loss, metrics = spec.compute_loss(LossInputs(logprobs, adv, response_mask, old_logprobs=..., returns=...))

What each spec needs (``spec.advantage_inputs()`` / ``spec.loss_inputs()`` list the field names):

===========================  ==========================================  =============================================
spec                         compute_advantages                          compute_loss
===========================  ==========================================  =============================================
grpo, dr_grpo, rloo,         rewards, group_ids, response_mask           logprobs, advantages, response_mask,
reinforce_pp_baseline                                                    old_logprobs (else on-policy)
reinforce_pp                 + old_logprobs, ref_logprobs (KL folded     same
                             into token rewards, β = kl_coef)
ppo                          + values (value head at rollout time);      + values (current), old_values, returns
                             + old/ref log-probs if kl_coef > 0
===========================  ==========================================  =============================================

``kl_mode="loss"`` specs with ``kl_coef > 0`` also need ``LossInputs.ref_logprobs``; ``entropy_coef > 0``
(``spec.needs_entropy``) needs ``LossInputs.entropy``, otherwise it may be ``None``. If ``AdvantageInputs.token_level_rewards`` is given it is used as is (the caller has folded in
any KL penalty); otherwise the spec builds it: the scalar reward on the last valid token minus β·KL per token.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field, ValidationError, model_validator
from torch import Tensor

from sara.algos.advantages import ADVANTAGES, AdvantageInputs, build_token_rewards
from sara.algos.aggregate import LOSS_AGG_MODES, LossDenominators, loss_denominators
from sara.algos.losses import KL_ESTIMATORS, LossInputs, kl_penalty, rl_loss
from sara.algos.options import errors_text, none_strings
from sara.config import ConfigError, SaraModel, parse_spec
from sara.registry import Registry, instance_of

__all__ = ["ALGOS", "AlgoSpec", "make_algo", "register_algo"]

KLMode = Literal["none", "loss", "reward"]
KLEstimator = Literal[KL_ESTIMATORS]  # type: ignore[valid-type]
AggMode = Literal[LOSS_AGG_MODES]  # type: ignore[valid-type]
_NORM_MODE = "seq-mean-token-sum-norm"


class AlgoSpec(SaraModel):
    """One RL algorithm as data: advantage estimator + loss settings + what the trainer must supply.

    A frozen pydantic model: every option is a validated field (ranges as ``Field`` constraints), and constructing
    one with an invalid value raises ``ConfigError`` naming the field and its valid range. Estimator options
    (``gamma``, ``lam``, ``eps``, ...) live in ``advantage_kwargs`` and are validated by the estimator's signature
    (``ADVANTAGES.params_model(advantage)``); ``replace`` / ``make_algo`` accept them by name.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    """Registry name."""
    advantage: str
    """Name of the estimator in ``ADVANTAGES`` (or ``"module:attr"``)."""
    advantage_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Options of the estimator (e.g. ``gamma``, ``lam``); only those set here, the others keep their defaults."""
    description: str = ""
    """One line for tables and ``--help``."""
    loss_agg_mode: AggMode = "token-mean"
    """How per-token losses become a scalar: one of ``LOSS_AGG_MODES`` (see ``sara.algos.losses.agg_loss``)."""
    norm_len: int | None = Field(None, gt=0)
    """Constant length of ``seq-mean-token-sum-norm`` (Dr.GRPO: e.g. the generation limit). ``None``: each
    loss call's padded length T, i.e. the longest response in it. Only valid with that aggregation mode."""
    clip_ratio_low: float = Field(0.2, gt=0.0, lt=1.0)
    """PPO clip ε below 1, in (0, 1)."""
    clip_ratio_high: float = Field(0.2, gt=0.0)
    """PPO clip ε above 1, > 0 (DAPO's clip-higher raises it)."""
    dual_clip_c: float | None = Field(None, gt=1.0)
    """Dual-clip constant (> 1) capping the loss of negative-advantage tokens, or ``None``."""
    drop_zero_adv_groups: bool = False
    """Drop all-zero-advantage groups from the policy-loss denominator (TRL #6367)."""
    needs_critic: bool = False
    """The policy must have a value head; adds the clipped value loss."""
    vf_coef: float = Field(0.5, ge=0.0)
    """Value-loss weight (>= 0)."""
    value_clip: float | None = Field(0.5, gt=0.0)
    """Value clip range (> 0), ``None``: no clipping."""
    kl_mode: KLMode = "none"
    """``"none"``, ``"loss"`` (β·KL added to the loss) or ``"reward"`` (−β·KL folded into the token rewards)."""
    kl_coef: float = Field(0.0, ge=0.0)
    """β (>= 0; 0 disables KL and the reference policy)."""
    kl_estimator: KLEstimator = "k3"
    """``"k1"``, ``"k2"`` or ``"k3"`` (see ``kl_penalty``)."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of the entropy bonus (>= 0); 0 means the trainer need not compute entropy (``needs_entropy``)."""
    epochs: int = Field(1, ge=1)
    """Suggested optimizer passes over each collected batch (>= 1)."""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(
                f"algorithm {data.get('name', '?')!r}: {errors_text(exc, type(self))}"
            ) from None

    @model_validator(mode="before")
    @classmethod
    def _check_estimator(cls, data: Any) -> Any:
        data = none_strings(cls, data)
        if not isinstance(data, dict) or not isinstance(data.get("advantage"), str):
            return data
        try:
            params = ADVANTAGES.params_model(data["advantage"])
        except KeyError as exc:
            raise ValueError(f"field 'advantage': {exc.args[0]}") from None
        kwargs = data.get("advantage_kwargs") or {}
        if not isinstance(kwargs, dict):
            return data
        unknown = sorted(set(kwargs) - set(params.model_fields))
        if unknown:
            takes = sorted(params.model_fields) or "nothing"
            raise ValueError(
                f"field 'advantage_kwargs': {data['advantage']!r} takes no {unknown}; it takes {takes}"
            )
        try:
            checked = params.model_validate(kwargs)
        except ValidationError as exc:
            raise ValueError(errors_text(exc, params)) from None
        return {**data, "advantage_kwargs": {k: getattr(checked, k) for k in kwargs}}

    @model_validator(mode="after")
    def _check_combinations(self) -> AlgoSpec:
        if self.kl_mode == "none" and self.kl_coef > 0:
            raise ValueError(
                f"field 'kl_coef': is {self.kl_coef} but kl_mode is 'none'; set kl_mode to 'loss' or 'reward'"
            )
        if self.kl_mode == "reward" and ADVANTAGES.is_outcome_level(self.advantage):
            raise ValueError(
                f"field 'kl_mode': 'reward' has no effect with the outcome-level estimator {self.advantage!r}; use 'loss'"
            )
        if self.norm_len is not None and self.loss_agg_mode != _NORM_MODE:
            raise ValueError(
                f"field 'norm_len': only used by loss_agg_mode {_NORM_MODE!r} (loss_agg_mode is {self.loss_agg_mode!r})"
            )
        return self

    def __hash__(self) -> int:  # the generated hash would fail on the advantage_kwargs dict
        return hash(repr({**self.__dict__, "advantage_kwargs": sorted(self.advantage_kwargs.items())}))

    # ------------------------------------------------------------------------------------------ what the trainer supplies
    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must compute ``ref_logprobs`` (a frozen reference policy)."""
        return self.kl_mode != "none" and self.kl_coef > 0

    @property
    def needs_entropy(self) -> bool:
        """Whether ``compute_loss`` needs ``LossInputs.entropy`` (``entropy_coef > 0``); else it may be ``None``."""
        return self.entropy_coef > 0

    @property
    def kl_in_reward(self) -> bool:
        """Whether −β·KL is folded into the token rewards (REINFORCE++ / PPO style)."""
        return self.kl_mode == "reward" and self.kl_coef > 0

    @property
    def kl_loss_coef(self) -> float:
        """β of the KL-in-loss term (0 unless ``kl_mode == "loss"``)."""
        return self.kl_coef if self.kl_mode == "loss" else 0.0

    def advantage_inputs(self) -> tuple[str, ...]:
        """``AdvantageInputs`` fields ``compute_advantages`` needs."""
        need = ["rewards", "group_ids", "response_mask"]
        if self.needs_critic:
            need.append("values")
        if self.kl_in_reward:
            need += ["old_logprobs", "ref_logprobs"]
        return tuple(need)

    def loss_inputs(self) -> tuple[str, ...]:
        """``LossInputs`` fields ``compute_loss`` needs (``old_logprobs`` may be omitted for on-policy updates)."""
        need = ["logprobs", "advantages", "response_mask", "old_logprobs"]
        if self.kl_loss_coef > 0:
            need.append("ref_logprobs")
        if self.needs_entropy:
            need.append("entropy")
        if self.needs_critic:
            need += ["values", "old_values", "returns"]
        if self.drop_zero_adv_groups:
            need.append("group_ids")
        return tuple(need)

    # ------------------------------------------------------------------------------------------------ the entry points
    def compute_advantages(self, inputs: AdvantageInputs) -> tuple[Tensor, Tensor | None]:
        """Advantages ``[N, T]`` (0 on masked tokens, no gradient) and value targets ``[N, T]`` (critic specs) or None.

        Raises:
            ValueError: an input this spec needs is missing (the message names it).
        """
        missing = [n for n in self.advantage_inputs() if getattr(inputs, n) is None]
        if self.kl_in_reward and inputs.token_level_rewards is not None:
            missing = [n for n in missing if n not in ("old_logprobs", "ref_logprobs")]
        if missing:
            raise ValueError(f"algorithm {self.name!r} needs AdvantageInputs.{', '.join(missing)}")
        with torch.no_grad():
            if self.kl_in_reward and inputs.token_level_rewards is None:
                kl = kl_penalty(inputs.old_logprobs, inputs.ref_logprobs, self.kl_estimator)  # type: ignore[arg-type]
                token_rewards = build_token_rewards(
                    inputs.rewards, inputs.response_mask, kl=kl, kl_coef=self.kl_coef
                )
                inputs = dataclasses.replace(inputs, token_level_rewards=token_rewards)
            adv, returns = ADVANTAGES.get(self.advantage)(inputs, **self.advantage_kwargs)
        if self.needs_critic and returns is None:
            raise ValueError(
                f"algorithm {self.name!r} has a critic but {self.advantage!r} returned no value targets"
            )
        return adv.detach(), (returns.detach() if returns is not None else None)

    def loss_denominators(self, advantages: Tensor, response_mask: Tensor, group_ids: Tensor | None = None
                          ) -> LossDenominators:
        """What this spec's loss divides by on a mini-batch ``[N, T]`` (``sara.algos.aggregate.loss_denominators``)."""
        return loss_denominators(advantages, response_mask, self.loss_agg_mode, drop_zero_adv=self.drop_zero_adv_groups,
                                 group_ids=group_ids)

    def compute_loss(self, inputs: LossInputs, denominators: LossDenominators | None = None
                     ) -> tuple[Tensor, dict[str, float]]:
        """The scalar loss and ``algo/...`` metrics (``rl_loss``); ``denominators``: the mini-batch's, for a micro-batch."""
        return rl_loss(
            inputs,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            dual_clip_c=self.dual_clip_c,
            agg_mode=self.loss_agg_mode,
            norm_len=self.norm_len,
            drop_zero_adv=self.drop_zero_adv_groups,
            kl_loss_coef=self.kl_loss_coef,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
            critic=self.needs_critic,
            vf_coef=self.vf_coef,
            value_clip=self.value_clip,
            denominators=denominators,
        )

    def replace(self, **overrides: Any) -> AlgoSpec:
        """A validated copy with some fields changed; keys that are estimator parameters go to ``advantage_kwargs``.

        String values (from spec strings / the command line) are coerced to the field's type (``"none"`` → None).

        Raises:
            ConfigError: unknown option or invalid value (the message names the field).
        """
        fields = type(self).model_fields
        adv_name = overrides.get("advantage", self.advantage)
        try:
            params = ADVANTAGES.params_model(adv_name).model_fields
        except KeyError as exc:
            raise ConfigError(f"algorithm {self.name!r}: field 'advantage': {exc.args[0]}") from None
        data: dict[str, Any] = {f: getattr(self, f) for f in fields}
        adv_kwargs = dict(self.advantage_kwargs) if adv_name == self.advantage else {}
        for key, value in overrides.items():
            if key == "advantage_kwargs":
                adv_kwargs.update(value)
            elif key in fields:
                data[key] = value
            elif key in params:
                adv_kwargs[key] = value
            else:
                known = sorted(set(fields) - {"advantage_kwargs"} | set(params))
                raise ConfigError(
                    f"algorithm {self.name!r}: field {key!r}: unknown option; known options: {', '.join(known)}"
                )
        data["advantage_kwargs"] = adv_kwargs
        return type(self)(**data)

    def options(self) -> dict[str, Any]:
        """All settings as a flat dict (estimator parameters included, with their defaults), for logs and tables."""
        out = {k: v for k, v in self.__dict__.items() if k != "advantage_kwargs"}
        params = ADVANTAGES.params_model(self.advantage).model_fields
        out.update({k: self.advantage_kwargs.get(k, info.get_default()) for k, info in params.items()})
        out["needs_reference"] = self.needs_reference
        out["needs_entropy"] = self.needs_entropy
        return out


# ------------------------------------------------------------------------------------------------------------ registry
ALGOS: Registry[AlgoSpec] = Registry("algorithm", accepts=instance_of(AlgoSpec), expects="a sara.algos.AlgoSpec")


def register_algo(spec: AlgoSpec, *, override: bool = False) -> AlgoSpec:
    """Register ``spec`` under ``spec.name``."""
    ALGOS.register(spec.name, spec, override=override)
    return spec


def make_algo(spec: str | AlgoSpec, **defaults: Any) -> AlgoSpec:
    """Build a spec from ``"name"`` / ``"name:key=value,..."`` (or return an ``AlgoSpec`` unchanged).

    Args:
        spec: e.g. ``"grpo"``, ``"ppo:lam=0.95,kl_coef=0.01"``, ``"grpo:drop_zero_adv_groups=true"``.
        **defaults: overrides applied before the spec string's own.

    Raises:
        ConfigError: unknown algorithm or invalid option (the message names it).
    """
    if isinstance(spec, AlgoSpec):
        return spec.replace(**defaults) if defaults else spec
    name, options = parse_spec(spec)
    try:
        base = ALGOS.get(name)
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    if not isinstance(base, AlgoSpec):
        raise ConfigError(f"{name!r} is not an AlgoSpec (got {type(base).__name__})")
    merged = {**defaults, **options}
    return base.replace(**merged) if merged else base


register_algo(
    AlgoSpec(
        name="grpo",
        advantage="grpo",
        description="GRPO: (r − mean_g)/(std_g + eps) per group, PPO-clip, token-mean loss",
        kl_mode="loss",
    )
)
register_algo(
    AlgoSpec(
        name="dr_grpo",
        advantage="dr_grpo",
        description="Dr.GRPO: r − mean_g (no std), token sums over a constant length",
        kl_mode="loss",
        loss_agg_mode="seq-mean-token-sum-norm",
    )
)
register_algo(
    AlgoSpec(
        name="rloo",
        advantage="rloo",
        description="RLOO: r − mean of the other group members, PPO-clip, token-mean loss",
        kl_mode="loss",
    )
)
register_algo(
    AlgoSpec(
        name="reinforce_pp_baseline",
        advantage="reinforce_pp_baseline",
        description="REINFORCE++-baseline: group-mean baseline, whitened over the batch's tokens",
        kl_mode="loss",
        kl_estimator="k3",
    )
)
register_algo(
    AlgoSpec(
        name="reinforce_pp",
        advantage="reinforce_pp",
        advantage_kwargs={"gamma": 1.0},
        description="REINFORCE++: token rewards with −β·KL (k1), whitened return-to-go",
        kl_mode="reward",
        kl_estimator="k1",
        kl_coef=0.01,
    )
)
register_algo(
    AlgoSpec(
        name="ppo",
        advantage="gae",
        advantage_kwargs={"gamma": 1.0, "lam": 1.0},
        description="PPO: value head + GAE (whitened), clipped policy and value losses",
        needs_critic=True,
        vf_coef=0.5,
        value_clip=0.5,
        kl_mode="reward",
        kl_estimator="k1",
        kl_coef=0.0,
    )
)
