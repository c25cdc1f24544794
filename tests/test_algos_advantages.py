"""Advantage estimators against hand-computed values, direct loops and group-id invariances."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from sara.algos.advantages import ADVANTAGES, AdvantageInputs  # noqa: E402
from sara.algos.estimators import (  # noqa: E402
    gae_advantages,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    reinforce_pp_returns,
    rloo_advantages,
)
from sara.algos.tensors import (  # noqa: E402
    broadcast_to_tokens,
    build_token_rewards,
    last_token_index,
    masked_mean,
    masked_var,
    masked_whiten,
)

K8_3 = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])


def _ids(n: int, value: int = 0) -> torch.Tensor:
    return torch.full((n,), value, dtype=torch.long)


# ------------------------------------------------------------------------------------------------ hand-computed values
def test_grpo_k8_three_successes_hand_values() -> None:
    adv = grpo_advantages(K8_3, _ids(8))
    # mean 3/8, unbiased std sqrt(15/56) = 0.517549
    assert adv[:3] == pytest.approx([1.2076] * 3, abs=1e-4)
    assert adv[3:] == pytest.approx([-0.7246] * 5, abs=1e-4)
    std = math.sqrt(15 / 56)
    assert adv[0].item() == pytest.approx(0.625 / (std + 1e-6), rel=1e-6)
    assert adv.dtype == torch.float32


def test_rloo_k8_three_successes_hand_values() -> None:
    adv = rloo_advantages(K8_3, _ids(8))
    assert adv[:3] == pytest.approx([5 / 7] * 3, rel=1e-6)  # 1 − 2/7
    assert adv[3:] == pytest.approx([-3 / 7] * 5, rel=1e-6)  # 0 − 3/7
    assert adv[0].item() == pytest.approx(0.7143, abs=1e-4)
    assert adv[3].item() == pytest.approx(-0.4286, abs=1e-4)


def test_rloo_is_reward_minus_mean_of_others() -> None:
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(6, generator=gen, dtype=torch.float64)
    adv = rloo_advantages(r, _ids(6))
    for i in range(6):
        others = torch.cat([r[:i], r[i + 1 :]])
        assert adv[i].item() == pytest.approx((r[i] - others.mean()).item(), abs=1e-12)


def test_dr_grpo_is_mean_centred_only() -> None:
    adv = grpo_advantages(K8_3, _ids(8), normalize_std=False)
    assert adv[:3] == pytest.approx([0.625] * 3)
    assert adv[3:] == pytest.approx([-0.375] * 5)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-7)


def test_grpo_eps_enters_denominator() -> None:
    r = torch.tensor([0.0, 1.0])  # unbiased std = sqrt(0.5)
    adv = grpo_advantages(r, _ids(2), eps=0.5)
    assert adv[1].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 0.5), rel=1e-6)


# ---------------------------------------------------------------------------------- singletons, saturation, variable k
@pytest.mark.parametrize(
    "fn", [grpo_advantages, rloo_advantages, lambda r, g: grpo_advantages(r, g, normalize_std=False)]
)
def test_singletons_and_saturated_groups_get_exactly_zero(fn) -> None:
    # group 7: singleton (verl would give it its raw reward 1.0); group 3: all ones; group 5: all 0.1 (rounding-prone)
    r = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.3, 0.7])
    g = torch.tensor([7, 3, 3, 3, 5, 5, 5, 9, 9])
    adv = fn(r, g)
    assert torch.equal(adv[:7], torch.zeros(7))
    assert (adv[7:] != 0).all()


def test_variable_group_sizes_match_per_group_computation() -> None:
    sizes = [1, 2, 3, 5, 8, 4]
    gen = torch.Generator().manual_seed(1)
    r = (torch.rand(sum(sizes), generator=gen) < 0.5).to(torch.float32)
    r[1:3] = torch.tensor([0.0, 1.0])  # keep the k=2 group mixed
    g = torch.cat([_ids(k, 10 * i) for i, k in enumerate(sizes)])
    adv_g = grpo_advantages(r, g)
    adv_r = rloo_advantages(r, g)
    start = 0
    for k in sizes:
        rg = r[start : start + k].double()
        if k == 1 or rg.max() == rg.min():
            exp_g = torch.zeros(k, dtype=torch.float64)
            exp_r = torch.zeros(k, dtype=torch.float64)
        else:
            exp_g = (rg - rg.mean()) / (rg.std() + 1e-6)  # torch.std is unbiased
            exp_r = k / (k - 1) * (rg - rg.mean())
        assert torch.allclose(adv_g[start : start + k].double(), exp_g, atol=1e-6)
        assert torch.allclose(adv_r[start : start + k].double(), exp_r, atol=1e-6)
        start += k


def test_shuffled_noncontiguous_group_ids_give_same_per_rollout_result() -> None:
    gen = torch.Generator().manual_seed(2)
    sizes = [3, 1, 6, 2, 4]
    r = torch.rand(sum(sizes), generator=gen)
    g_sorted = torch.cat([_ids(k, i) for i, k in enumerate(sizes)])
    labels = torch.tensor([904, -17, 3, 1_000_003, 42])  # arbitrary, unsorted, non-contiguous
    g = labels[g_sorted]
    perm = torch.randperm(r.numel(), generator=gen)
    mask = torch.ones(r.numel(), 5)
    for fn in (grpo_advantages, rloo_advantages):
        ref = fn(r, g_sorted)
        assert torch.allclose(fn(r[perm], g[perm]), ref[perm], atol=1e-6)
    ref = reinforce_pp_baseline_advantages(r, g_sorted, mask)
    assert torch.allclose(
        reinforce_pp_baseline_advantages(r[perm], g[perm], mask[perm]), ref[perm], atol=1e-6
    )


def test_integer_rewards_and_float64_dtype() -> None:
    adv = grpo_advantages(torch.tensor([1, 0, 0, 1]), _ids(4))
    assert adv.dtype == torch.get_default_dtype()
    adv64 = rloo_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), _ids(2))
    assert adv64.dtype == torch.float64


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="integers"):
        rloo_advantages(torch.zeros(4), torch.zeros(4))
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))


# ------------------------------------------------------------------------------------------------------------- helpers
def test_broadcast_and_last_token_and_token_rewards() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert torch.equal(out, torch.tensor([[2.0, 2, 2, 0], [-1, -1, -1, -1], [0, 0, 0, 0]]))
    assert last_token_index(mask).tolist() == [2, 3, 0]
    kl = torch.full((3, 4), 0.5)
    tr = build_token_rewards(torch.tensor([1.0, 0.0, 1.0]), mask, kl=kl, kl_coef=0.1)
    expected = torch.tensor([[-0.05, -0.05, 0.95, 0.0], [-0.05, -0.05, -0.05, -0.05], [0.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(tr, expected)


def test_masked_statistics() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.5)
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([1.5, 3.5])
    assert masked_var(x, mask).item() == pytest.approx(torch.tensor([1.0, 2, 3, 4]).var().item())
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(1.25)
    w = masked_whiten(x, mask)
    assert w[:, 2].tolist() == [0.0, 0.0]
    assert torch.allclose(w[mask.bool()], (torch.tensor([1.0, 2, 3, 4]) - 2.5) / math.sqrt(5 / 3 + 1e-8))
    # fewer than two valid positions: variance 0, no division by zero
    one = torch.zeros(2, 3, dtype=torch.long)
    one[0, 0] = 1
    assert torch.equal(masked_whiten(x, one), torch.zeros(2, 3))


# ------------------------------------------------------------------------------------------------------- REINFORCE++
def _whitening_stats(adv: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    v = adv[mask.bool()].double()
    return v.mean().item(), v.var().item()


def test_reinforce_pp_baseline_centres_then_whitens_over_valid_tokens() -> None:
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    g = torch.tensor([0, 0, 0, 1, 1, 2])  # group 1 saturated, group 2 singleton
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
    adv = reinforce_pp_baseline_advantages(r, g, mask)
    mean, var = _whitening_stats(adv, mask)
    assert mean == pytest.approx(0.0, abs=1e-6)
    assert var == pytest.approx(1.0, abs=1e-5)
    assert torch.equal(adv[~mask.bool()], torch.zeros(int((~mask.bool()).sum())))
    # direct computation: centred scores 2/3, -1/3, -1/3, 0, 0, 0 tiled over tokens
    centred = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], dtype=torch.float64)
    tok = centred[:, None].expand(-1, 4)[mask.bool()]
    expected = (tok - tok.mean()) / torch.sqrt(tok.var() + 1e-8)
    assert torch.allclose(adv[mask.bool()].double(), expected, atol=1e-6)
    # saturated group and singleton are NOT zero after whitening (the batch mean is shifted out)
    assert (adv[3:][mask[3:].bool()] != 0).all()


def _return_to_go_loop(tr: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    out = torch.zeros_like(tr, dtype=torch.float64)
    for i in range(tr.shape[0]):
        valid = [t for t in range(tr.shape[1]) if mask[i, t]]
        g = 0.0
        for t in reversed(valid):
            g = tr[i, t].item() + gamma * g
            out[i, t] = g
    return out


def test_reinforce_pp_returns_match_loop_and_are_whitened() -> None:
    gen = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    tr = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    adv, ret = reinforce_pp_returns(tr, mask, gamma=0.9)
    expected = _return_to_go_loop(tr, mask, 0.9)
    assert torch.allclose(ret, expected, atol=1e-12)
    mean, var = _whitening_stats(adv, mask)
    assert mean == pytest.approx(0.0, abs=1e-9)
    assert var == pytest.approx(1.0, abs=1e-6)
    v = expected[mask.bool()]
    assert torch.allclose(adv[mask.bool()], (v - v.mean()) / torch.sqrt(v.var() + 1e-8), atol=1e-9)


def test_reinforce_pp_gamma_one_outcome_reward_is_constant_per_sequence() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    tr = build_token_rewards(torch.tensor([1.0, 0.0]), mask)
    _, ret = reinforce_pp_returns(tr, mask)
    assert torch.equal(ret, torch.tensor([[1.0, 1, 1, 0], [0, 0, 0, 0]]))


# ---------------------------------------------------------------------------------------------------------------- GAE
def _gae_loop(tr, values, mask, gamma, lam):
    adv = torch.zeros_like(tr, dtype=torch.float64)
    for i in range(tr.shape[0]):
        valid = [t for t in range(tr.shape[1]) if mask[i, t]]
        a_next, v_next = 0.0, 0.0
        for t in reversed(valid):
            delta = tr[i, t].item() + gamma * v_next - values[i, t].item()
            a_next = delta + gamma * lam * a_next
            v_next = values[i, t].item()
            adv[i, t] = a_next
    return adv


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_direct_loop(gamma: float, lam: float) -> None:
    gen = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    tr = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    values = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    adv, ret = gae_advantages(tr, values, mask, gamma=gamma, lam=lam)
    raw = _gae_loop(tr, values, mask, gamma, lam)
    m = mask.bool()
    assert torch.allclose(ret[m], (raw + values)[m], atol=1e-12)
    assert torch.equal(ret[~m], torch.zeros(int((~m).sum()), dtype=torch.float64))
    v = raw[m]
    assert torch.allclose(adv[m], (v - v.mean()) / torch.sqrt(v.var() + 1e-8), atol=1e-9)
    assert torch.equal(adv[~m], torch.zeros(int((~m).sum()), dtype=torch.float64))


def test_gae_lambda_one_gamma_one_is_return_minus_value() -> None:
    mask = torch.ones(2, 3)
    tr = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.6], [0.1, 0.1, 0.1]])
    _, ret = gae_advantages(tr, values, mask)
    # returns = A + V = Monte-Carlo return-to-go when γ = λ = 1
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]))


# ----------------------------------------------------------------------------------------------- registry adapters
def _random_inputs(seed: int = 5) -> AdvantageInputs:
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 3, 8, 5, 2]
    n = sum(sizes)
    g = torch.cat([torch.full((k,), 100 - 7 * i) for i, k in enumerate(sizes)])
    lengths = torch.randint(1, 9, (n,), generator=gen)
    mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
    return AdvantageInputs(
        rewards=(torch.rand(n, generator=gen) < 0.5).float(),
        group_ids=g,
        response_mask=mask,
        values=torch.randn(n, 8, generator=gen),
    )


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "reinforce_pp", "gae"])
def test_registered_estimators_share_one_signature(name: str) -> None:
    inputs = _random_inputs()
    adv, ret = ADVANTAGES.get(name)(inputs)
    assert adv.shape == inputs.response_mask.shape
    assert torch.isfinite(adv).all()
    assert torch.equal(adv[inputs.response_mask == 0], torch.zeros(int((inputs.response_mask == 0).sum())))
    assert (ret is not None) == (name == "gae")


def test_outcome_adapters_tile_the_per_rollout_advantage() -> None:
    inputs = _random_inputs()
    adv, _ = ADVANTAGES.get("rloo")(inputs)
    expected = broadcast_to_tokens(rloo_advantages(inputs.rewards, inputs.group_ids), inputs.response_mask)
    assert torch.equal(adv, expected)


def test_gae_adapter_requires_values() -> None:
    inputs = _random_inputs()
    inputs.values = None
    with pytest.raises(ValueError, match="values"):
        ADVANTAGES.get("gae")(inputs)


# ------------------------------------------------------------------------------------------------------ properties
@settings(max_examples=40, deadline=None)
@given(
    groups=st.lists(
        st.lists(st.sampled_from([0.0, 1.0, 0.5, 0.25]), min_size=1, max_size=9), min_size=1, max_size=8
    ),
    seed=st.integers(0, 2**16),
)
def test_group_baseline_properties(groups: list[list[float]], seed: int) -> None:
    r = torch.tensor([x for grp in groups for x in grp], dtype=torch.float64)
    labels = torch.randperm(1000, generator=torch.Generator().manual_seed(seed))[: len(groups)] - 500
    g = torch.cat([torch.full((len(grp),), int(lab)) for grp, lab in zip(groups, labels)])
    adv_g = grpo_advantages(r, g, eps=0.0)
    adv_dr = grpo_advantages(r, g, normalize_std=False)
    adv_r = rloo_advantages(r, g)
    for lab, grp in zip(labels.tolist(), groups):
        sel = g == lab
        mixed = len(set(grp)) > 1
        for adv in (adv_g, adv_dr, adv_r):
            assert adv[sel].sum().item() == pytest.approx(0.0, abs=1e-9)  # advantages sum to zero per group
            assert bool((adv[sel] == 0).all()) == (not mixed)  # exactly zero iff singleton / saturated
        if mixed:
            assert adv_g[sel].std().item() == pytest.approx(1.0, rel=1e-9)  # unit unbiased std per group
            k = len(grp)
            assert torch.allclose(adv_r[sel], adv_dr[sel] * k / (k - 1))


# ---------------------------------------------------------------------------------------------------------- layout
def test_advantages_module_reexports_the_split_modules() -> None:
    from sara.algos import advantages, estimators, tensors

    for mod in (tensors, estimators):
        for name in mod.__all__:
            assert getattr(advantages, name) is getattr(mod, name) and name in advantages.__all__
    assert ADVANTAGES.outcome_level_names() == {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"}
    gae = ADVANTAGES.params_model("gae")
    assert set(gae.model_fields) == {"gamma", "lam"} and gae().lam == 1.0
    assert ADVANTAGES.params_model("rloo").model_fields == {}
