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

``kl_mode="loss"`` specs with ``kl_coef > 0`` also need ``LossInputs.ref_logprobs``; ``entropy_coef > 0`` needs
``LossInputs.entropy``. If ``AdvantageInputs.token_level_rewards`` is given it is used as is (the caller has folded in
any KL penalty); otherwise the spec builds it: the scalar reward on the last valid token minus β·KL per token.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import TypeAdapter, ValidationError
from torch import Tensor

from sara.algos.advantages import ADVANTAGES, AdvantageInputs, build_token_rewards
from sara.algos.losses import KL_ESTIMATORS, LOSS_AGG_MODES, LossInputs, kl_penalty, rl_loss
from sara.config import ConfigError, parse_spec
from sara.registry import Registry

__all__ = ["ALGOS", "AlgoSpec", "OUTCOME_ESTIMATORS", "make_algo", "register_algo"]

OUTCOME_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"})
"""Estimators that only use the scalar ``rewards`` (a KL penalty in the reward would be ignored by them)."""

KLMode = Literal["none", "loss", "reward"]


@dataclass(frozen=True)
class AlgoSpec:
    """One RL algorithm as data: advantage estimator + loss settings + what the trainer must supply.

    Attributes:
        name: registry name.
        advantage: name of the estimator in ``ADVANTAGES`` (or ``"module:attr"``).
        advantage_kwargs: keyword arguments for the estimator (e.g. ``gamma``, ``lam``).
        description: one line for tables and ``--help``.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        clip_ratio_low: PPO clip ε below 1.
        clip_ratio_high: PPO clip ε above 1 (DAPO's clip-higher raises it).
        dual_clip_c: dual-clip constant (> 1) or ``None``.
        drop_zero_adv_groups: drop all-zero-advantage groups from the policy-loss denominator (TRL #6367).
        needs_critic: the policy must have a value head; adds the clipped value loss.
        vf_coef: value-loss weight.
        value_clip: value clip range (``None``: no clipping).
        kl_mode: ``"none"``, ``"loss"`` (β·KL added to the loss) or ``"reward"`` (−β·KL folded into token rewards).
        kl_coef: β (0 disables KL and the reference policy).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see ``kl_penalty``).
        entropy_coef: weight of the entropy bonus.
        epochs: suggested optimizer passes over each collected batch.
        min_group_size: smallest group that can carry signal (2 for group baselines: singletons get 0).
    """

    name: str
    advantage: str
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    loss_agg_mode: str = "token-mean"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    dual_clip_c: float | None = None
    drop_zero_adv_groups: bool = False
    needs_critic: bool = False
    vf_coef: float = 0.5
    value_clip: float | None = 0.5
    kl_mode: KLMode = "none"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    epochs: int = 1
    min_group_size: int = 1

    def __post_init__(self) -> None:
        def bad(fld: str, msg: str) -> ConfigError:
            return ConfigError(f"algorithm {self.name!r}: field '{fld}': {msg}")

        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise bad(
                "loss_agg_mode", f"must be one of {', '.join(LOSS_AGG_MODES)} (got {self.loss_agg_mode!r})"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise bad(
                "kl_estimator", f"must be one of {', '.join(KL_ESTIMATORS)} (got {self.kl_estimator!r})"
            )
        if self.kl_mode not in ("none", "loss", "reward"):
            raise bad("kl_mode", f"must be 'none', 'loss' or 'reward' (got {self.kl_mode!r})")
        if self.kl_mode == "none" and self.kl_coef > 0:
            raise bad(
                "kl_coef", f"is {self.kl_coef} but kl_mode is 'none'; set kl_mode to 'loss' or 'reward'"
            )
        if self.kl_mode == "reward" and self.advantage in OUTCOME_ESTIMATORS:
            raise bad(
                "kl_mode",
                f"'reward' has no effect with the outcome-level estimator {self.advantage!r}; use 'loss'",
            )
        for fld in ("clip_ratio_low", "clip_ratio_high", "vf_coef", "kl_coef", "entropy_coef"):
            if not getattr(self, fld) >= 0:
                raise bad(fld, f"must be >= 0 (got {getattr(self, fld)!r})")
        if self.clip_ratio_low >= 1:
            raise bad("clip_ratio_low", f"must be < 1 (got {self.clip_ratio_low!r})")
        if self.dual_clip_c is not None and not self.dual_clip_c > 1:
            raise bad("dual_clip_c", f"must be > 1 or None (got {self.dual_clip_c!r})")
        if self.value_clip is not None and not self.value_clip > 0:
            raise bad("value_clip", f"must be > 0 or None (got {self.value_clip!r})")
        if self.epochs < 1:
            raise bad("epochs", f"must be >= 1 (got {self.epochs!r})")
        if self.min_group_size < 1:
            raise bad("min_group_size", f"must be >= 1 (got {self.min_group_size!r})")
        try:
            fn = ADVANTAGES.get(self.advantage)
        except KeyError as exc:
            raise bad("advantage", str(exc.args[0])) from None
        params = _estimator_params(fn)
        unknown = sorted(set(self.advantage_kwargs) - set(params))
        if unknown:
            raise bad(
                "advantage_kwargs",
                f"{self.advantage!r} takes no {unknown}; it takes {sorted(params) or 'nothing'}",
            )

    def __hash__(self) -> int:  # the generated hash would fail on the advantage_kwargs dict
        return hash(repr(self))

    # ------------------------------------------------------------------------------------------ what the trainer supplies
    @property
    def needs_reference(self) -> bool:
        """Whether the trainer must compute ``ref_logprobs`` (a frozen reference policy)."""
        return self.kl_mode != "none" and self.kl_coef > 0

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
        if self.entropy_coef > 0:
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

    def compute_loss(self, inputs: LossInputs) -> tuple[Tensor, dict[str, float]]:
        """The scalar loss to minimise and ``algo/...`` metrics (see ``sara.algos.losses.rl_loss``)."""
        return rl_loss(
            inputs,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            dual_clip_c=self.dual_clip_c,
            agg_mode=self.loss_agg_mode,
            drop_zero_adv=self.drop_zero_adv_groups,
            kl_loss_coef=self.kl_loss_coef,
            kl_estimator=self.kl_estimator,
            entropy_coef=self.entropy_coef,
            critic=self.needs_critic,
            vf_coef=self.vf_coef,
            value_clip=self.value_clip,
        )

    def replace(self, **overrides: Any) -> AlgoSpec:
        """A validated copy with some fields changed; keys that are estimator parameters go to ``advantage_kwargs``.

        String values (from spec strings / the command line) are coerced to the field's type.

        Raises:
            ConfigError: unknown option or invalid value (the message names the field).
        """
        fields = {f.name: f for f in dataclasses.fields(self) if f.init}
        adv_name = overrides.get("advantage", self.advantage)
        try:
            params = _estimator_params(ADVANTAGES.get(adv_name))
        except KeyError as exc:
            raise ConfigError(f"algorithm {self.name!r}: field 'advantage': {exc.args[0]}") from None
        data: dict[str, Any] = {f: getattr(self, f) for f in fields}
        adv_kwargs = dict(self.advantage_kwargs) if adv_name == self.advantage else {}
        for key, value in overrides.items():
            if key in fields and key != "advantage_kwargs":
                data[key] = _coerce(self.name, key, _field_types()[key], value)
            elif key in params:
                default = params[key]
                data_type = type(default) if default is not None else Any
                adv_kwargs[key] = _coerce(self.name, key, data_type, value)
            elif key == "advantage_kwargs":
                adv_kwargs.update(value)
            else:
                known = sorted(set(fields) - {"advantage_kwargs"} | set(params))
                raise ConfigError(
                    f"algorithm {self.name!r}: field {key!r}: unknown option; known options: {', '.join(known)}"
                )
        data["advantage_kwargs"] = adv_kwargs
        return AlgoSpec(**data)

    def options(self) -> dict[str, Any]:
        """All settings as a flat dict (estimator parameters included, with their defaults), for logs and tables."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "advantage_kwargs"
        }
        params = _estimator_params(ADVANTAGES.get(self.advantage))
        out.update({k: self.advantage_kwargs.get(k, v) for k, v in params.items()})
        out["needs_reference"] = self.needs_reference
        return out


def _coerce(algo: str, key: str, tp: Any, value: Any) -> Any:
    adapter = TypeAdapter(tp)
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        # "value_clip=none" on the command line means None where the field admits it
        if isinstance(value, str) and value.strip().lower() == "none":
            try:
                return adapter.validate_python(None)
            except ValidationError:
                pass
        msg = exc.errors()[0]["msg"]
        raise ConfigError(f"algorithm {algo!r}: field {key!r}: {msg} (got {value!r})") from None


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(AlgoSpec)


def _estimator_params(fn: Any) -> dict[str, Any]:
    """Keyword-only parameters (with defaults) of a registered estimator."""
    return {
        p.name: (None if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(fn).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


# ------------------------------------------------------------------------------------------------------------ registry
ALGOS: Registry[AlgoSpec] = Registry("algorithm")


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
        min_group_size=2,
    )
)
register_algo(
    AlgoSpec(
        name="dr_grpo",
        advantage="dr_grpo",
        description="Dr.GRPO: r − mean_g (no std), token sums over a constant length",
        kl_mode="loss",
        loss_agg_mode="seq-mean-token-sum-norm",
        min_group_size=2,
    )
)
register_algo(
    AlgoSpec(
        name="rloo",
        advantage="rloo",
        description="RLOO: r − mean of the other group members, PPO-clip, token-mean loss",
        kl_mode="loss",
        min_group_size=2,
    )
)
register_algo(
    AlgoSpec(
        name="reinforce_pp_baseline",
        advantage="reinforce_pp_baseline",
        description="REINFORCE++-baseline: group-mean baseline, whitened over the batch's tokens",
        kl_mode="loss",
        kl_estimator="k3",
        min_group_size=2,
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
