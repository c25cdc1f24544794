"""The prefix every row of a mini-batch shares (a few-shot preamble) is forwarded once per mini-batch without a graph
and once more with one for its backward (``sara.train.prefix_grad.SharedPrefix``), not once per micro-batch, no
prefix graph is held through the micro-batches, and the update is unchanged: the parameters'
gradients before the optimizer step and the metrics equal one plain forward's and the per-micro-batch path's, with
1, 2 and more micro-batches, mini-batches, a critic, a reference and recomputed old log-probs (the no-grad scoring
shares the prefix too); gradient checkpointing keeps today's path. A tiny random float32 Llama (tests/
test_learner_fast.py's); no model download."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sara.algos import make_algo  # noqa: E402
from sara.train import Learner, OptimConfig, make_batch  # noqa: E402
from sara.train.microbatch import plan_microbatches, shared_prefix  # noqa: E402
from sara.train.prefix_grad import SharedPrefix  # noqa: E402
from tests.test_learner_fast import (  # noqa: E402
    VOCAB,
    PlainView,
    assert_same_step,
    captured_step,
    groups_of,
    tiny_llama,
)

PREAMBLE = 20


def preamble_groups(seed: int = 0, n_groups: int = 8):
    """Every prompt starts with one 20-token preamble; then one of two 4-token sub-prefixes or none (rows sharing a
    longer prefix than the batch's), then a question of 1-3 tokens; completions of 1-6 tokens, mixed rewards."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    pre, subs = rand(PREAMBLE), [rand(4), rand(4), []]
    return groups_of(((*pre, *subs[gid % 3], *rand(1 + gid % 3)) for gid in range(n_groups)), rand, max_tokens=6)


class DecoderCalls:
    """Records ``(rows, positions, cached positions before)`` of every call of the policy's decoder."""

    def __init__(self, policy):
        self.calls: list[tuple[int, int, int]] = []
        decoder = policy.model.get_decoder()
        forward = decoder.forward

        def counted(*args, input_ids=None, past_key_values=None, **kwargs):
            past = 0 if past_key_values is None else int(past_key_values.get_seq_length())
            self.calls.append((*input_ids.shape, past))
            return forward(*args, input_ids=input_ids, past_key_values=past_key_values, **kwargs)

        decoder.forward = counted

    def positions(self) -> int:
        return sum(rows * n for rows, n, _ in self.calls)


def per_micro_batch(monkeypatch):
    """Today's path: no prefix given, each micro-batch forwards its own shared prefix."""
    monkeypatch.setattr(SharedPrefix, "forward", classmethod(lambda cls, policy, batch, length: None))


@pytest.mark.parametrize("budget, micro", [(None, 1), (150, 2), (60, 3)])
@pytest.mark.parametrize("algo", ["grpo", "grpo:entropy_coef=0.01,loss_agg_mode=seq-mean-token-sum"])
def test_the_update_with_the_prefix_once_equals_one_forward_and_the_per_micro_batch_path(algo, budget, micro,
                                                                                         monkeypatch):
    spec = make_algo(algo)
    pol = tiny_llama()
    b = make_batch(preamble_groups())
    once = Learner(pol, spec, OptimConfig(lr=1e-3, microbatch_tokens=budget, grad_clip=1.0), seed=0)
    shared, plan = once._prepare(pol, b)
    assert shared is not None and shared.kv.length == PREAMBLE
    assert all(x.is_leaf and x.requires_grad for x in shared.kv.tensors)  # no prefix graph kept across micro-batches
    assert (len(plan) == micro) if micro < 3 else len(plan) >= micro
    assert all(m.given == PREAMBLE and m.prefix >= PREAMBLE for m in plan)
    if micro > 1:
        assert any(m.prefix > PREAMBLE for m in plan)  # some rows share more: that part runs on top, per micro-batch
    calls = DecoderCalls(pol)
    got = captured_step(once, b)
    assert calls.calls[0] == calls.calls[-1] == (1, PREAMBLE, 0)  # the preamble: without a graph, then for its backward
    assert all(past >= PREAMBLE for _, _, past in calls.calls[1:-1])  # every micro-batch on top of it
    assert calls.positions() == 2 * PREAMBLE + sum(m.tokens for m in plan)
    plain = Learner(PlainView(pol), spec, OptimConfig(lr=1e-3, microbatch_tokens=None, grad_clip=1.0), seed=0)
    assert_same_step(got, captured_step(plain, b))
    per_micro_batch(monkeypatch)
    each = Learner(pol, spec, OptimConfig(lr=1e-3, microbatch_tokens=budget, grad_clip=1.0), seed=0)
    assert each._prepare(pol, b)[0] is None and all(m.given == 0 for m in each._plan(b))
    assert_same_step(got, captured_step(each, b))


@pytest.mark.parametrize("algo, optim", [("ppo", {"minibatch_rollouts": 7, "epochs": 2}),
                                         ("grpo:kl_mode=loss,kl_coef=0.1", {"minibatch_rollouts": 9})])
def test_mini_batches_a_critic_a_reference_and_recomputed_old_logprobs(algo, optim, monkeypatch):
    spec = make_algo(algo)
    pol = tiny_llama(value_head=spec.needs_critic)
    b = make_batch(preamble_groups(seed=3))
    once = Learner(pol, spec, OptimConfig(lr=1e-7, microbatch_tokens=50, **optim), seed=0)
    got = captured_step(once, b)
    plain = Learner(PlainView(pol), spec, OptimConfig(lr=1e-7, microbatch_tokens=None, **optim), seed=0)
    assert_same_step(got, captured_step(plain, b))
    per_micro_batch(monkeypatch)
    each = Learner(pol, spec, OptimConfig(lr=1e-7, microbatch_tokens=50, **optim), seed=0)
    assert_same_step(got, captured_step(each, b))


def test_the_preamble_is_forwarded_once_per_mini_batch_and_once_per_no_grad_scoring():
    spec = make_algo("grpo")
    pol = tiny_llama()
    b = make_batch(preamble_groups(seed=1))
    n = len(b.rewards)
    learner = Learner(pol, spec, OptimConfig(lr=1e-3, microbatch_tokens=60, minibatch_rollouts=(n + 1) // 2), seed=0)
    calls = DecoderCalls(pol)
    adv = learner.advantages(b)  # more than one optimizer step: old log-probs recomputed without gradient
    assert sum(past == 0 for _, _, past in calls.calls) == 1 and calls.calls[0] == (1, PREAMBLE, 0)
    assert len(calls.calls) > 2
    calls.calls.clear()
    learner.update(b, *adv, step=0)
    starts = [c for c in calls.calls if c[2] == 0]
    assert starts == [(1, PREAMBLE, 0)] * 4  # two mini-batches, the preamble twice each (then for its backward)
    assert len(calls.calls) > 4


def test_gradient_checkpointing_keeps_the_plain_path():
    # (and runs: a checkpointed layer's recomputation in the backward picks the same attention kernel as its forward)
    spec = make_algo("grpo")
    pol = tiny_llama(gradient_checkpointing=True)
    assert pol.model.is_gradient_checkpointing
    b = make_batch(preamble_groups(seed=2))
    learner = Learner(pol, spec, OptimConfig(lr=1e-3, microbatch_tokens=60), seed=0)
    assert learner._prepare(pol, b)[0] is None and len(learner._plan(b)) > 2
    calls = DecoderCalls(pol)
    got = captured_step(learner, b)
    assert calls.calls and all(past == 0 and rows > 0 for rows, _, past in calls.calls)  # nothing shared
    plain = Learner(PlainView(tiny_llama()), spec, OptimConfig(lr=1e-3, microbatch_tokens=None), seed=0)
    assert_same_step(got, captured_step(plain, b))


def test_the_plan_counts_the_given_prefix_once():
    prompts = [(*range(1, 21), 30 + i % 3, 40 + i) for i in range(12)]
    lengths = [len(p) + 1 + i % 4 for i, p in enumerate(prompts)]
    assert shared_prefix(prompts) == 20 and shared_prefix(prompts, min_prefix=21) == 0
    assert shared_prefix([(1, 2, 3)] * 2, min_prefix=1) == 2  # never a whole prompt
    for budget in (None, 40, 80):
        plan = plan_microbatches(prompts, lengths, budget, given=20)
        assert sorted(int(r) for m in plan for r in m.rows) == list(range(12))
        for m in plan:
            assert m.given == 20 and m.tokens == m.prefix - 20 + len(m.rows) * (m.width - m.prefix)
            assert budget is None or m.tokens <= budget or len(m.rows) == 1
    assert all(m.given == 0 for m in plan_microbatches(prompts, lengths, 40))  # the per-micro-batch plan is kept
    assert all(m.given == 0 for m in plan_microbatches(prompts, lengths, 40, share=False, given=20))
