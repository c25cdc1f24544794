"""The Learner on its own: padding by group id, one policy forward per mini-batch, the LR schedule, the update."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sara.algos import make_algo  # noqa: E402
from sara.policies.tiny import TinyPolicy  # noqa: E402
from sara.train import Learner, OptimConfig, lr_at, make_batch  # noqa: E402
from sara.train.learner import planned_optimizer_steps  # noqa: E402
from sara.types import Decision, Group, Prompt, Rollout  # noqa: E402

SMALL = {"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 16}


def groups(sizes=(3, 1, 4), seed=0):
    """Groups of the given sizes (a singleton included) whose rollouts carry prompt + completion token ids."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for gid, size in enumerate(sizes):
        prompt_ids = (1, *torch.randint(3, 12, (2 + gid,), generator=gen).tolist())
        rs = []
        for j in range(size):
            n = 1 + (gid + j) % 4
            toks = tuple(torch.randint(3, 12, (n,), generator=gen).tolist())
            rs.append(Rollout(prompt_id=f"p{gid}", pool_index=gid, completion="x", reward=float((gid + j) % 2),
                              num_tokens=n, token_ids=toks, logprobs=tuple([-1.0] * n),
                              prompt_token_ids=prompt_ids))
        out.append(Group(group_id=10 + gid, prompt=Prompt(id=f"p{gid}", prompt="q"), pool_index=gid,
                         rollouts=tuple(rs), decision=Decision.COMMIT))
    return out


class CountingPolicy(TinyPolicy):
    """A tiny policy that records each ``score`` call's options."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls: list[tuple[int, bool, bool]] = []

    def score(self, batch, *, with_entropy=False, with_values=False):
        self.calls.append((batch.input_ids.shape[0], with_entropy, with_values))
        return super().score(batch, with_entropy=with_entropy, with_values=with_values)


def test_make_batch_pads_by_group_id_and_masks_responses():
    gs = groups()
    b = make_batch(gs)
    n = sum(len(g.rollouts) for g in gs)
    assert b.rewards.shape == (n,) and b.group_ids.tolist() == [10, 10, 10, 11, 12, 12, 12, 12]
    lens = [len(r.token_ids) for g in gs for r in g.rollouts]
    assert b.response_mask.sum(1).tolist() == lens
    for i, r in enumerate(r for g in gs for r in g.rollouts):  # response positions hold the completion tokens
        got = b.tokens.input_ids[i].gather(0, b.resp_index[i][: len(r.token_ids)]).tolist()
        assert got == list(r.token_ids)
    assert make_batch([]) is None


def test_make_batch_rejects_rollouts_without_token_ids():
    g = groups((1,))[0]
    bad = Group(group_id=0, prompt=g.prompt, pool_index=0, decision=Decision.COMMIT,
                rollouts=(Rollout(prompt_id="p0", pool_index=0, completion="x", reward=1.0, num_tokens=1),))
    with pytest.raises(RuntimeError, match="token ids"):
        make_batch([bad])


@pytest.mark.parametrize("algo, entropy, values", [("grpo", False, False), ("grpo:entropy_coef=0.01", True, False),
                                                   ("ppo", False, True)])
def test_one_policy_forward_per_minibatch(algo, entropy, values):
    spec = make_algo(algo)
    pol = CountingPolicy({**SMALL, "value_head": spec.needs_critic})
    learner = Learner(pol, spec, OptimConfig(lr=1e-3, minibatch_rollouts=3, epochs=2), seed=0)
    b = learner.make_batch(groups())
    adv, ret, extra = learner.advantages(b)
    assert pol.calls == [(8, False, values)]  # rollout-time log-probs and values in one no-grad pass
    pol.calls.clear()
    metrics = learner.update(b, adv, ret, extra, step=0)
    assert [c[0] for c in pol.calls] == [3, 3, 2, 3, 3, 2]  # 2 epochs x ceil(8 / 3) mini-batches, one call each
    assert all(c[1:] == (entropy, values) for c in pol.calls)
    assert learner.optimizer_steps == 6 and metrics["algo/optimizer_steps"] == 6.0


def test_update_changes_the_weights_and_state_round_trips():
    spec = make_algo("grpo")
    pol = TinyPolicy(SMALL)
    learner = Learner(pol, spec, OptimConfig(lr=1e-2), seed=0)
    before = {k: v.clone() for k, v in pol.state_dict().items()}
    b = learner.make_batch(groups())
    learner.update(b, *learner.advantages(b), step=0)
    assert any(not torch.equal(before[k], v) for k, v in pol.state_dict().items())
    other = Learner(TinyPolicy(SMALL), spec, OptimConfig(lr=1e-2), seed=0)
    other.load_state_dict(learner.state_dict())
    assert other.optimizer_steps == learner.optimizer_steps == 1
    assert all(torch.equal(v, other.policy.state_dict()[k]) for k, v in pol.state_dict().items())


def test_reference_policy_is_a_frozen_copy_only_when_needed():
    assert Learner(TinyPolicy(SMALL), make_algo("grpo"), OptimConfig()).reference is None
    ref = Learner(TinyPolicy(SMALL), make_algo("reinforce_pp"), OptimConfig()).reference
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())


def test_lr_schedule_follows_optimizer_steps():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="linear")
    assert [lr_at(cfg, s, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 9, 14) == pytest.approx(0.5) and lr_at(cfg, 14, 14) == 0.0
    cos = OptimConfig(lr=2.0, schedule="cosine", total_optimizer_steps=10)
    assert lr_at(cos, 5, 999) == pytest.approx(1.0) and lr_at(cos, 10, 999) == pytest.approx(0.0)
    assert lr_at(OptimConfig(lr=0.3), 1000, 1) == 0.3
    assert planned_optimizer_steps(10, 4, 8, 2, 16) == 10 * 2 * math.ceil(32 / 16)
    assert planned_optimizer_steps(10, 4, 8, 1, None) == 10


def test_stale_rollouts_take_the_generators_logprobs_as_old_logprobs():
    # A rollout started under older weights (a carrying streaming driver tags it with its step) is trained with the
    # generator's log-probs as old log-probs; fresh ones keep the trainer's; no tag or no step: nothing is stale.
    import dataclasses

    gs = groups()
    old = [dataclasses.replace(r, policy_version=4 if j else 3) for j, r in enumerate(gs[0].rollouts)]
    gs[0] = dataclasses.replace(gs[0], rollouts=tuple(old))
    learner = Learner(TinyPolicy(SMALL), make_algo("grpo"), OptimConfig(lr=1e-3, epochs=2), seed=0)  # recomputed
    assert make_batch(gs).stale is None and make_batch(groups(), version=4).stale is None
    b = learner.make_batch(gs, version=4)
    assert b.stale.tolist() == [True] + [False] * 7  # only the rollout of step 3
    _, _, extra = learner.advantages(b)
    m, old_lp = b.response_mask, extra["old_logprobs"]
    assert torch.equal(old_lp[0] * m[0], b.gen_logprobs[0] * m[0])  # the generator's -1.0 per token
    fresh = learner.advantages(learner.make_batch(groups()))[2]["old_logprobs"]
    assert torch.allclose(old_lp[1:], fresh[1:]) and not torch.allclose(old_lp[0] * m[0], fresh[0] * m[0])
    assert extra["metrics"]["algo/stale_fraction"] == pytest.approx(1 / 8)
    assert b.rows(torch.tensor([0, 2])).stale.tolist() == [True, False]


class LossSpy:
    """An ``AlgoSpec`` stand-in that records what ``compute_loss`` is given."""

    def __init__(self, spec):
        self.spec, self.inputs = spec, []

    def __getattr__(self, name):
        return getattr(self.spec, name)

    def compute_loss(self, inputs, denominators=None):
        self.inputs.append(inputs)
        return self.spec.compute_loss(inputs, denominators)


def test_one_pass_takes_old_logprobs_from_its_own_forward_and_stale_ones_from_the_generator():
    # One epoch, one mini-batch: no rollout-time forward; the loss sees the update forward's log-probs, detached, as
    # old log-probs (ratio 1) on fresh rows and the generator's on the stale row.
    import dataclasses

    gs = groups()
    gs[0] = dataclasses.replace(gs[0], rollouts=tuple(dataclasses.replace(r, policy_version=3 if j == 0
                                                                                        else 4)
                                                      for j, r in enumerate(gs[0].rollouts)))
    pol = CountingPolicy(SMALL)
    learner = Learner(pol, make_algo("grpo"), OptimConfig(lr=1e-3), seed=0)
    learner.algo = spy = LossSpy(learner.algo)
    b = learner.make_batch(gs, version=4)
    adv, ret, extra = learner.advantages(b)
    assert pol.calls == [] and extra["old_logprobs"] is None  # no forward before the update
    metrics = learner.update(b, adv, ret, extra, step=4)
    assert len(pol.calls) == 1 and metrics["algo/optimizer_steps"] == 1.0
    whole = spy.inputs[-1]  # the metrics pass over the whole mini-batch (rows in shuffled order)
    order = np.random.default_rng([0, 4, 0, 0x5EED]).permutation(8)
    stale = torch.as_tensor(order == 0)
    m = b.response_mask[order]
    assert torch.equal(whole.old_logprobs[stale] * m[stale], b.gen_logprobs[order][stale] * m[stale])
    assert torch.equal(whole.old_logprobs[~stale], whole.logprobs[~stale])
    assert spy.inputs[0].logprobs.requires_grad and not spy.inputs[0].old_logprobs.requires_grad
    assert "algo/gen_logprob_gap" in metrics and metrics["algo/ratio_max"] >= 1.0
