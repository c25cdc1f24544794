"""Algorithm specs: every registered spec through the uniform entry points; options; what the trainer must supply."""

from __future__ import annotations

import pickle

import pytest

torch = pytest.importorskip("torch")

from sara.algos import (  # noqa: E402
    ADVANTAGES,
    ALGOS,
    AdvantageInputs,
    AlgoSpec,
    LossInputs,
    broadcast_to_tokens,
    build_token_rewards,
    grpo_advantages,
    kl_penalty,
    make_algo,
    reinforce_pp_returns,
)
from sara.config import ConfigError  # noqa: E402

T = 7


def _batch(seed: int = 0):
    """Random batch: variable group sizes (incl. a singleton and a saturated group), shuffled non-contiguous ids."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 8, 5, 4]
    labels = [11, -3, 400, 7, 52, 1_000]
    g = torch.cat([torch.full((k,), lab) for k, lab in zip(sizes, labels)])
    n = g.numel()
    r = (torch.rand(n, generator=gen) < 0.5).float()
    r[g == 52] = 1.0  # saturated
    r[g == 7] = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0])  # mixed
    perm = torch.randperm(n, generator=gen)
    g, r = g[perm], r[perm]
    lengths = torch.randint(1, T + 1, (n,), generator=gen)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    logp = -torch.rand(n, T, generator=gen) * 3
    return {
        "rewards": r,
        "group_ids": g,
        "response_mask": mask,
        "values": torch.randn(n, T, generator=gen),
        "old_logprobs": logp,
        "ref_logprobs": logp + 0.3 * torch.randn(n, T, generator=gen),
        "logprobs": (logp + 0.05 * torch.randn(n, T, generator=gen)).requires_grad_(True),
        "entropy": torch.rand(n, T, generator=gen),
    }


def _adv_inputs(b) -> AdvantageInputs:
    return AdvantageInputs(
        rewards=b["rewards"],
        group_ids=b["group_ids"],
        response_mask=b["response_mask"],
        values=b["values"],
        old_logprobs=b["old_logprobs"],
        ref_logprobs=b["ref_logprobs"],
    )


@pytest.mark.parametrize("name", ALGOS.names())
def test_every_registered_spec_runs_the_uniform_entry_points(name: str) -> None:
    spec = ALGOS.get(name)
    b = _batch()
    adv, returns = spec.compute_advantages(_adv_inputs(b))
    mask = b["response_mask"]
    assert adv.shape == mask.shape and torch.isfinite(adv).all()
    assert not adv.requires_grad
    assert torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert (returns is not None) == spec.needs_critic
    values = b["values"].clone().requires_grad_(True)
    loss_in = LossInputs(
        logprobs=b["logprobs"],
        advantages=adv,
        response_mask=mask,
        old_logprobs=b["old_logprobs"],
        ref_logprobs=b["ref_logprobs"],
        entropy=b["entropy"],
        values=values,
        old_values=b["values"],
        returns=returns,
        group_ids=b["group_ids"],
    )
    loss, metrics = spec.compute_loss(loss_in)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(k.startswith("algo/") for k in metrics)
    loss.backward()
    assert torch.isfinite(b["logprobs"].grad).all()
    assert (values.grad is not None) == spec.needs_critic
    # the spec's declared needs are exactly the inputs it reads
    needed = set(spec.advantage_inputs())
    partial = AdvantageInputs(**{k: getattr(_adv_inputs(b), k) for k in needed})
    adv2, _ = spec.compute_advantages(partial)
    assert torch.equal(adv, adv2)


@pytest.mark.parametrize("name", ALGOS.names())
def test_saturated_groups_zero_signal_only_under_group_baselines(name: str) -> None:
    spec = ALGOS.get(name)
    b = _batch(1)
    adv, _ = spec.compute_advantages(_adv_inputs(b))
    saturated = (b["group_ids"] == 52)[:, None] & (b["response_mask"] == 1)
    singleton = (b["group_ids"] == 11)[:, None] & (b["response_mask"] == 1)
    zero = bool((adv[saturated] == 0).all() and (adv[singleton] == 0).all())
    assert zero == (name in {"grpo", "dr_grpo", "rloo"})


def test_grpo_spec_equals_the_pure_function_tiled() -> None:
    b = _batch(2)
    adv, ret = ALGOS.get("grpo").compute_advantages(_adv_inputs(b))
    expected = broadcast_to_tokens(grpo_advantages(b["rewards"], b["group_ids"]), b["response_mask"])
    assert torch.equal(adv, expected) and ret is None
    dr, _ = ALGOS.get("dr_grpo").compute_advantages(_adv_inputs(b))
    expected = broadcast_to_tokens(
        grpo_advantages(b["rewards"], b["group_ids"], normalize_std=False), b["response_mask"]
    )
    assert torch.equal(dr, expected)


def test_reinforce_pp_folds_k1_kl_into_token_rewards() -> None:
    spec = ALGOS.get("reinforce_pp")
    assert spec.needs_reference and spec.kl_in_reward and spec.kl_coef == pytest.approx(0.01)
    b = _batch(3)
    adv, _ = spec.compute_advantages(_adv_inputs(b))
    kl = kl_penalty(b["old_logprobs"], b["ref_logprobs"], "k1")
    tr = build_token_rewards(b["rewards"], b["response_mask"], kl=kl, kl_coef=0.01)
    expected, _ = reinforce_pp_returns(tr, b["response_mask"])
    assert torch.allclose(adv, expected)
    # caller-built token rewards are used as given (no reference needed then)
    given = AdvantageInputs(b["rewards"], b["group_ids"], b["response_mask"], token_level_rewards=tr)
    adv2, _ = spec.compute_advantages(given)
    assert torch.allclose(adv2, expected)
    with pytest.raises(ValueError, match="old_logprobs, ref_logprobs"):
        spec.compute_advantages(AdvantageInputs(b["rewards"], b["group_ids"], b["response_mask"]))


def test_ppo_needs_values_and_returns_targets() -> None:
    spec = ALGOS.get("ppo")
    assert spec.needs_critic and not spec.needs_reference
    assert spec.advantage_inputs() == ("rewards", "group_ids", "response_mask", "values")
    assert {"values", "old_values", "returns"} <= set(spec.loss_inputs())
    b = _batch(4)
    with pytest.raises(ValueError, match="values"):
        spec.compute_advantages(AdvantageInputs(b["rewards"], b["group_ids"], b["response_mask"]))
    with_kl = make_algo("ppo:kl_coef=0.05")
    assert with_kl.needs_reference and "ref_logprobs" in with_kl.advantage_inputs()


def test_needs_reference_follows_kl_settings() -> None:
    assert not ALGOS.get("grpo").needs_reference
    spec = make_algo("grpo:kl_coef=0.001")
    assert spec.needs_reference and spec.kl_loss_coef == pytest.approx(0.001)
    assert "ref_logprobs" in spec.loss_inputs()


def test_make_algo_options_and_errors() -> None:
    spec = make_algo("ppo:lam=0.95,gamma=0.99,dual_clip_c=3,value_clip=none,drop_zero_adv_groups=true")
    assert spec.advantage_kwargs == {"gamma": 0.99, "lam": 0.95}
    assert spec.dual_clip_c == 3.0 and spec.value_clip is None and spec.drop_zero_adv_groups is True
    assert ALGOS.get("ppo").advantage_kwargs == {"gamma": 1.0, "lam": 1.0}  # registry entry unchanged
    assert make_algo("grpo", clip_ratio_high=0.28).clip_ratio_high == pytest.approx(0.28)
    assert make_algo("rloo").options()["loss_agg_mode"] == "token-mean"
    for bad, field in [
        ("grpo:foo=1", "foo"),
        ("grpo:clip_ratio_low=x", "clip_ratio_low"),
        ("grpo:loss_agg_mode=sum", "loss_agg_mode"),
        ("grpo:kl_mode=reward", "kl_mode"),
        ("grpo:kl_mode=none,kl_coef=0.1", "kl_coef"),
        ("reinforce_pp:gamma=abc", "gamma"),
        ("ppo:dual_clip_c=0.5", "dual_clip_c"),
        ("ppo:kl_estimator=k9", "kl_estimator"),
    ]:
        with pytest.raises(ConfigError, match=field):
            make_algo(bad)
    with pytest.raises(ConfigError, match="unknown algorithm"):
        make_algo("a2c")


def test_custom_spec_and_pickling() -> None:
    spec = AlgoSpec(name="my_rloo", advantage="rloo", loss_agg_mode="seq-mean-token-mean")
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert len({spec, make_algo(spec), ALGOS.get("rloo")}) == 2  # hashable despite the kwargs dict
    with pytest.raises(ConfigError, match="advantage_kwargs"):
        AlgoSpec(name="bad", advantage="rloo", advantage_kwargs={"gamma": 1.0})
    with pytest.raises(ConfigError, match="advantage"):
        AlgoSpec(name="bad", advantage="nonexistent")


@pytest.mark.parametrize(
    ("bad", "field", "valid"),
    [
        ("ppo:lam=2", "lam", "[0, 1]"),
        ("ppo:lam=-0.1", "lam", "[0, 1]"),
        ("ppo:gamma=0", "gamma", "(0, 1]"),
        ("reinforce_pp:gamma=1.5", "gamma", "(0, 1]"),
        ("grpo:eps=-1", "eps", ">= 0"),
        ("grpo:clip_ratio_low=0", "clip_ratio_low", "(0, 1)"),
        ("grpo:clip_ratio_low=1", "clip_ratio_low", "(0, 1)"),
        ("grpo:clip_ratio_high=0", "clip_ratio_high", "> 0"),
        ("ppo:value_clip=0", "value_clip", "> 0"),
        ("grpo:kl_coef=-0.1", "kl_coef", ">= 0"),
        ("grpo:entropy_coef=-1", "entropy_coef", ">= 0"),
        ("ppo:vf_coef=-1", "vf_coef", ">= 0"),
        ("grpo:epochs=0", "epochs", ">= 1"),
        ("dr_grpo:norm_len=0", "norm_len", "> 0"),
        ("ppo:dual_clip_c=1", "dual_clip_c", "> 1"),
    ],
)
def test_option_ranges_raise_config_error_naming_field_and_range(bad: str, field: str, valid: str) -> None:
    with pytest.raises(ConfigError, match=f"field '{field}'") as info:
        make_algo(bad)
    assert f"valid range {valid}" in str(info.value)


def test_every_invalid_option_is_a_config_error_naming_the_field() -> None:
    for bad, field in [
        ("grpo:normalize_std=maybe", "normalize_std"),
        ("grpo:epochs=two", "epochs"),
        ("grpo:kl_mode=sometimes", "kl_mode"),
        ("grpo:norm_len=256", "norm_len"),  # only seq-mean-token-sum-norm uses it: not silently ignored
        ("grpo:min_group_size=2", "min_group_size"),  # removed: nothing read it
        ("grpo:advantage=nope", "advantage"),
    ]:
        with pytest.raises(ConfigError, match=f"field '{field}'"):
            make_algo(bad)
    with pytest.raises(ConfigError, match="field 'lam'"):
        AlgoSpec(name="x", advantage="gae", advantage_kwargs={"lam": 3}, needs_critic=True)
    # every registered spec keeps its defaults and stays valid when rebuilt from its own options
    for name in ALGOS.names():
        spec = ALGOS.get(name)
        assert make_algo(name) == spec and spec.replace() == spec


def test_user_outcome_level_estimator_gets_the_kl_mode_check() -> None:
    def mine(inputs: AdvantageInputs, *, scale: float = 1.0):
        adv = scale * grpo_advantages(inputs.rewards, inputs.group_ids)
        return broadcast_to_tokens(adv, inputs.response_mask), None

    ADVANTAGES.register("test_outcome_user", mine, outcome_level=True, override=True)
    ADVANTAGES.register("test_token_user", mine, override=True)
    assert ADVANTAGES.is_outcome_level("test_outcome_user")
    assert not ADVANTAGES.is_outcome_level("test_token_user")
    with pytest.raises(ConfigError, match="field 'kl_mode'.*outcome-level.*test_outcome_user"):
        AlgoSpec(name="u", advantage="test_outcome_user", kl_mode="reward", kl_coef=0.01)
    AlgoSpec(name="u", advantage="test_token_user", kl_mode="reward", kl_coef=0.01)  # not flagged: allowed
    spec = AlgoSpec(name="u", advantage="test_outcome_user", kl_mode="loss")
    with pytest.raises(ConfigError, match="field 'kl_mode'"):
        spec.replace(kl_mode="reward")
    # its options are typed by its signature
    assert spec.replace(scale="2").advantage_kwargs == {"scale": 2.0}
    with pytest.raises(ConfigError, match="field 'scale'"):
        spec.replace(scale="big")
    names = ADVANTAGES.outcome_level_names()
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "test_outcome_user"} <= names
    assert "test_token_user" not in names


def test_norm_len_sets_dr_grpo_constant_length() -> None:
    b = _batch(5)
    spec = ALGOS.get("dr_grpo")
    assert spec.norm_len is None and spec.loss_agg_mode == "seq-mean-token-sum-norm"
    adv, _ = spec.compute_advantages(_adv_inputs(b))

    def loss_of(s: AlgoSpec) -> float:
        inp = LossInputs(b["logprobs"], adv, b["response_mask"], old_logprobs=b["old_logprobs"])
        return float(s.compute_loss(inp)[0].detach())

    default = loss_of(spec)  # divides each sequence's token sum by this batch's padded length T
    assert default != 0
    fixed = make_algo("dr_grpo:norm_len=28")
    assert fixed.norm_len == 28 and fixed.options()["norm_len"] == 28
    assert loss_of(fixed) == pytest.approx(default * T / 28)  # the loss scales by T / norm_len
    assert loss_of(make_algo("dr_grpo:norm_len=7")) == pytest.approx(default)  # norm_len = T: unchanged


def test_needs_entropy_and_compute_loss_without_entropy() -> None:
    b = _batch(6)
    for name in ALGOS.names():
        spec = ALGOS.get(name)
        assert not spec.needs_entropy and "entropy" not in spec.loss_inputs()
        adv, returns = spec.compute_advantages(_adv_inputs(b))
        loss_in = LossInputs(
            logprobs=b["logprobs"], advantages=adv, response_mask=b["response_mask"],
            old_logprobs=b["old_logprobs"], ref_logprobs=b["ref_logprobs"], entropy=None,
            values=b["values"].clone().requires_grad_(True), old_values=b["values"], returns=returns,
        )  # fmt: skip
        loss, metrics = spec.compute_loss(loss_in)
        assert torch.isfinite(loss) and "algo/entropy" not in metrics
    with_ent = make_algo("grpo:entropy_coef=0.01")
    assert with_ent.needs_entropy and "entropy" in with_ent.loss_inputs()
    adv, _ = with_ent.compute_advantages(_adv_inputs(b))
    with pytest.raises(ValueError, match="entropy"):
        with_ent.compute_loss(LossInputs(b["logprobs"], adv, b["response_mask"], entropy=None))
    _, metrics = with_ent.compute_loss(
        LossInputs(b["logprobs"], adv, b["response_mask"], entropy=b["entropy"])
    )
    assert "algo/entropy" in metrics
