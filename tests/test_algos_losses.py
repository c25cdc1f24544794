"""Losses: aggregation modes by hand, clipping, dual clip, KL estimators, value loss, dead-group dropping."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from sara.algos.losses import (  # noqa: E402
    LossInputs,
    active_mask,
    agg_loss,
    entropy_bonus,
    kl_penalty,
    loss_denominator,
    policy_loss,
    rl_loss,
    value_loss,
)

# two sequences: 3 valid tokens and 1 valid token, T = 4
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 50.0, 60.0, 70.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-mean", (2.0 + 4.0) / 2),
        ("seq-mean-token-sum", (6.0 + 4.0) / 2),
        ("seq-mean-token-sum-norm", (6.0 / 4 + 4.0 / 4) / 2),
    ],
)
def test_agg_modes_against_hand_values(mode: str, expected: float) -> None:
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_agg_norm_len_denominator_and_empty_rows() -> None:
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(
        (0.6 + 0.4) / 2
    )
    # gradient accumulation: dividing by the whole mini-batch's count
    assert agg_loss(LOSS, MASK, "token-mean", denominator=8).item() == pytest.approx(10 / 8)
    # a row with no valid token is not counted by the seq-mean modes
    loss3 = torch.cat([LOSS, torch.full((1, 4), 9.0)])
    mask3 = torch.cat([MASK, torch.zeros(1, 4, dtype=torch.long)])
    assert loss_denominator(mask3, "seq-mean-token-mean") == 2
    assert loss_denominator(mask3, "token-mean") == 4
    assert agg_loss(loss3, mask3, "seq-mean-token-mean").item() == pytest.approx(3.0)
    # nothing valid: 0, not NaN
    assert agg_loss(LOSS, torch.zeros_like(MASK), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="aggregation mode"):
        agg_loss(LOSS, MASK, "sum")


def test_policy_loss_on_policy_is_minus_mean_advantage_and_gradient_is_advantage() -> None:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.ones(1, 3)
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask)
    assert loss.item() == pytest.approx(-(1 - 2 + 0.5) / 3)
    loss.backward()
    assert torch.allclose(logp.grad, -adv / 3)  # d(−A·ρ)/dlogp = −A·ρ with ρ = 1
    assert metrics["algo/pg_clipfrac"] == 0.0
    assert metrics["algo/ppo_kl"] == pytest.approx(0.0)
    assert metrics["algo/approx_kl"] == pytest.approx(0.0)


def test_policy_loss_clipping_hand_values() -> None:
    # ratios: 1.5 (A>0 → clipped to 1.2), 0.5 (A>0 → unclipped, min of the objective), 0.5 (A<0 → clipped to 0.8),
    #         1.5 (A<0 → unclipped)
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5]])
    old = torch.zeros(1, 4)
    logp = torch.log(ratio).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, metrics = policy_loss(logp, old, adv, torch.ones(1, 4))
    expected = [-1.2, -0.5, 0.8, 1.5]
    assert loss.item() == pytest.approx(sum(expected) / 4)
    assert metrics["algo/pg_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    # clipped tokens carry no gradient
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 2].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(-1.0 * 0.5 / 4)
    assert logp.grad[0, 3].item() == pytest.approx(1.0 * 1.5 / 4)


def test_clip_higher_asymmetric_ratios() -> None:
    logp = torch.log(torch.tensor([[1.25, 1.25]]))
    adv = torch.tensor([[1.0, 1.0]])
    sym, _ = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2))
    high, m = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_ratio_high=0.28)
    assert sym.item() == pytest.approx(-1.2)
    assert high.item() == pytest.approx(-1.25)
    assert m["algo/pg_clipfrac"] == 0.0


def test_dual_clip_caps_negative_advantage_loss() -> None:
    logp = torch.log(torch.tensor([[10.0, 10.0]]))
    adv = torch.tensor([[-1.0, 1.0]])
    plain, m0 = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2))
    dual, m1 = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), dual_clip_c=3.0)
    assert plain.item() == pytest.approx((10.0 - 1.2) / 2)
    assert dual.item() == pytest.approx((3.0 - 1.2) / 2)
    assert m0["algo/pg_clipfrac_lower"] == 0.0
    assert m1["algo/pg_clipfrac_lower"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="dual_clip_c"):
        policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), dual_clip_c=1.0)


def test_drop_zero_adv_groups_changes_only_the_denominator() -> None:
    # groups: 0 mixed (two sequences), 1 saturated (all-zero advantages); 3 tokens each
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3, [0.0] * 3, [0.0] * 3])
    gid = torch.tensor([5, 5, 2, 2])
    mask = torch.ones(4, 3)
    logp = torch.log(torch.tensor([[1.1] * 3, [0.9] * 3, [1.3] * 3, [0.7] * 3]))
    old = torch.zeros(4, 3)
    kept, m_kept = policy_loss(logp, old, adv, mask)
    dropped, m_drop = policy_loss(logp, old, adv, mask, drop_zero_adv=True, group_ids=gid)
    numerator = 3 * (-1.1) + 3 * 0.9
    assert kept.item() == pytest.approx(numerator / 12)
    assert dropped.item() == pytest.approx(numerator / 6)
    assert m_kept["algo/active_token_frac"] == pytest.approx(0.5)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        a, _ = policy_loss(logp, old, adv, mask, agg_mode=mode)
        b, _ = policy_loss(logp, old, adv, mask, agg_mode=mode, drop_zero_adv=True, group_ids=gid)
        assert b.item() == pytest.approx(2 * a.item())
    # nothing live: loss 0, not NaN
    z, _ = policy_loss(logp, old, torch.zeros(4, 3), mask, drop_zero_adv=True, group_ids=gid)
    assert z.item() == 0.0


def test_active_mask_keeps_mixed_groups_whole() -> None:
    adv = torch.tensor([[0.0, 0.0], [0.5, 0.5], [0.0, 0.0]])  # member 0 exactly zero inside a live group
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    by_group = active_mask(adv, mask, torch.tensor([1, 1, 2]))
    assert by_group.tolist() == [[True, True], [True, False], [False, False]]
    by_seq = active_mask(adv, mask)
    assert by_seq.tolist() == [[False, False], [True, False], [False, False]]


def test_kl_estimators_properties() -> None:
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(64, 16, generator=gen)
    ref = logp + 0.5 * torch.randn(64, 16, generator=gen)
    k1 = kl_penalty(logp, ref, "k1")
    k2 = kl_penalty(logp, ref, "k2")
    k3 = kl_penalty(logp, ref, "k3")
    assert (k1 < 0).any()  # k1 is unbiased but not pointwise positive
    assert (k3 >= 0).all() and (k2 >= 0).all()
    x = logp - ref
    assert torch.allclose(k3, torch.exp(-x) - 1 + x, atol=1e-6)
    assert torch.equal(kl_penalty(logp, logp, "k3"), torch.zeros_like(logp))
    assert torch.equal(kl_penalty(logp, logp, "k1"), torch.zeros_like(logp))
    # k3 stays bounded for huge log-ratios
    assert kl_penalty(torch.tensor([-100.0]), torch.tensor([0.0]), "k3").item() == 10.0
    with pytest.raises(ValueError, match="KL estimator"):
        kl_penalty(logp, ref, "k4")


def test_k1_and_k3_are_unbiased_for_the_true_kl() -> None:
    # π = N(0.3, 1), π_ref = N(0, 1) over a scalar "token": KL(π‖π_ref) = 0.045
    gen = torch.Generator().manual_seed(1)
    x = 0.3 + torch.randn(200_000, generator=gen, dtype=torch.float64)
    logp = -0.5 * (x - 0.3) ** 2
    ref = -0.5 * x**2
    assert kl_penalty(logp, ref, "k1").mean().item() == pytest.approx(0.045, abs=3e-3)
    assert kl_penalty(logp, ref, "k3").mean().item() == pytest.approx(0.045, abs=3e-3)


def test_value_loss_clipping() -> None:
    old = torch.tensor([[0.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 0.3, -1.0]], requires_grad=True)
    returns = torch.tensor([[2.0, 1.0, 1.0]])
    loss, m = value_loss(values, old, returns, torch.ones(1, 3), clip_range=0.5)
    # token 0: max((1−2)², (0.5−2)²) = 2.25 (clipped); token 1: max(0.49, 0.49); token 2: max(4, 2.25) = 4
    assert loss.item() == pytest.approx(0.5 * (2.25 + 0.49 + 4.0) / 3)
    assert m["algo/vf_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    assert values.grad[0, 0].item() == 0.0  # the clipped branch has no gradient
    unclipped, _ = value_loss(values, old, returns, torch.ones(1, 3), clip_range=None)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.49 + 4.0) / 3)


def test_entropy_bonus_and_rl_loss_combination() -> None:
    gen = torch.Generator().manual_seed(2)
    n, t = 4, 5
    logp = torch.randn(n, t, generator=gen).requires_grad_(True)
    old = logp.detach() + 0.1 * torch.randn(n, t, generator=gen)
    ref = logp.detach() + 0.2 * torch.randn(n, t, generator=gen)
    adv = torch.randn(n, t, generator=gen)
    ent = torch.rand(n, t, generator=gen)
    values = torch.randn(n, t, generator=gen).requires_grad_(True)
    old_values = values.detach() + 0.1
    returns = torch.randn(n, t, generator=gen)
    mask = torch.ones(n, t)
    mask[0, 3:] = 0
    inp = LossInputs(logp, adv, mask, old_logprobs=old, ref_logprobs=ref, entropy=ent, values=values,
                     old_values=old_values, returns=returns)  # fmt: skip
    total, metrics = rl_loss(inp, kl_loss_coef=0.1, entropy_coef=0.01, critic=True, vf_coef=0.5)
    pg, _ = policy_loss(logp, old, adv, mask)
    kl = agg_loss(kl_penalty(logp, ref, "k3"), mask)
    h, _ = entropy_bonus(ent, mask)
    vf, _ = value_loss(values, old_values, returns, mask)
    assert total.item() == pytest.approx((pg + 0.1 * kl - 0.01 * h + 0.5 * vf).item(), rel=1e-6)
    assert metrics["algo/loss"] == pytest.approx(total.item())
    assert {"algo/kl", "algo/entropy", "algo/vf_loss", "algo/pg_loss"} <= set(metrics)
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    total.backward()
    assert values.grad is not None and logp.grad is not None


def test_rl_loss_names_missing_inputs() -> None:
    logp = torch.zeros(2, 3)
    inp = LossInputs(logp, torch.ones(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="ref_logprobs"):
        rl_loss(inp, kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        rl_loss(inp, entropy_coef=0.1)
    with pytest.raises(ValueError, match="values, old_values, returns"):
        rl_loss(inp, critic=True)
    # on-policy default: old_logprobs omitted means ratio 1
    loss, m = rl_loss(inp)
    assert loss.item() == pytest.approx(-1.0) and m["algo/ppo_kl"] == 0.0
