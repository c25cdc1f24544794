"""The fast learner is exact (float32): the shared-prefix forward (``HFPolicy.score_at``) gives ``score``'s log-probs,
entropies, values and gradients, its vocabulary projection in chunks of rows (``sara.policies.vocab``) those of one
``[K, V]`` softmax without keeping or making a ``[K, V]`` tensor; micro-batches under a token budget accumulate the
gradient and report the metrics of one forward over the mini-batch, for every loss aggregation mode; the micro-batch
plan covers every row once, within the budget, with prefixes the rows really share. A tiny random Llama (RoPE:
positions matter) stands in for SmolLM2; no model download."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sara.algos import make_algo  # noqa: E402
from sara.policies.base import PrefixScorer, TokenBatch  # noqa: E402
from sara.policies.tiny import TinyPolicy  # noqa: E402
from sara.train import Learner, OptimConfig, make_batch  # noqa: E402
from sara.train.microbatch import plan_microbatches  # noqa: E402
from sara.types import Decision, Group, Prompt, Rollout  # noqa: E402

VOCAB = 97


def tiny_llama(value_head: bool = False, seed: int = 0, **options):
    """A 2-layer random Llama as an ``HFPolicy`` (float32 weights and compute; ``options``: more ``HFPolicy``
    options)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sara.policies.hf import HFPolicy

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return HFPolicy(LlamaForCausalLM(cfg), tokenizer=object(), value_head=value_head, compute_dtype="float32",
                    **options)


class PlainView:
    """The same policy without the ``PrefixScorer`` capability: the learner's plain path (``score`` + gather)."""

    def __init__(self, policy):
        self.policy, self.has_value_head = policy, policy.has_value_head

    def score(self, batch, *, with_entropy=False, with_values=False):
        return self.policy.score(batch, with_entropy=with_entropy, with_values=with_values)

    def parameters(self):
        return self.policy.parameters()

    def state_dict(self):
        return self.policy.state_dict()

    def load_state_dict(self, state):
        return self.policy.load_state_dict(state)


def prefixed_groups(seed: int = 0, n_groups: int = 7, vocab: int = VOCAB, lo: int = 3):
    """Groups whose prompts start with one of three distinct few-shot prefixes (9, 12 and 10 tokens; the last shares
    its first 3 tokens with the first), then a question of 1-3 tokens; completions of 1-5 tokens, mixed rewards."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(lo, vocab, (n,), generator=gen).tolist()

    a = rand(9)
    prefixes = [a, rand(12), a[:3] + rand(7)]
    return groups_of(((*prefixes[gid % 3], *rand(1 + gid % 3)) for gid in range(n_groups)), rand, max_tokens=5)


def groups_of(prompts, rand, *, max_tokens: int):
    """One committed group per prompt of the iterable ``prompts`` (ids ``p0, p1, ...``): 1-4 rollouts of
    1-``max_tokens`` tokens drawn by ``rand(n)`` right after their prompt (a lazy iterable keeps the draws
    interleaved), rewards mixed by a fixed pattern."""
    out = []
    for gid, prompt in enumerate(prompts):
        n = [1 + (gid + 2 * j) % max_tokens for j in range(1 + gid % 4)]
        rollouts = tuple(Rollout(prompt_id=f"p{gid}", pool_index=gid, completion="x", reward=float((gid + j) % 3 == 0),
                                 num_tokens=m, token_ids=tuple(rand(m)), logprobs=tuple([-2.0] * m),
                                 prompt_token_ids=tuple(prompt)) for j, m in enumerate(n))
        out.append(Group(group_id=gid, prompt=Prompt(id=f"p{gid}", prompt="q"), pool_index=gid, rollouts=rollouts,
                         decision=Decision.COMMIT))
    return out


def captured_step(learner: Learner, batch, step: int = 0):
    """Run one ``update``; return ``(metrics, [the gradients at each optimizer step])``; the policy's weights are put
    back afterwards (so two learners over one policy start from the same weights)."""
    grads: list[list[torch.Tensor]] = []
    start = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    handle = learner.optimizer.register_step_pre_hook(
        lambda opt, *_: grads.append([p.grad.detach().clone() for p in opt.param_groups[0]["params"]]))
    try:
        metrics = learner.update(batch, *learner.advantages(batch), step=step)
    finally:
        handle.remove()
        learner.policy.load_state_dict(start)
    return metrics, grads


def assert_same_step(a, b, rtol=1e-4, atol=1e-7):
    (ma, ga), (mb, gb) = a, b
    assert len(ga) == len(gb) >= 1
    for step_a, step_b in zip(ga, gb):
        for g, h in zip(step_a, step_b, strict=True):
            torch.testing.assert_close(g, h, rtol=rtol, atol=atol)
    for key in ("algo/pg_loss", "algo/loss", "algo/grad_norm", "algo/ppo_kl", "algo/entropy", "algo/vf_loss",
                "algo/kl"):
        if key in ma or key in mb:
            assert ma[key] == pytest.approx(mb[key], rel=1e-4, abs=1e-7), key


def test_the_hf_policy_has_the_capability_and_the_tiny_one_keeps_the_plain_path():
    assert isinstance(tiny_llama(), PrefixScorer)
    assert not isinstance(TinyPolicy({"d_model": 16, "n_layers": 1, "n_heads": 2}), PrefixScorer)
    assert not isinstance(PlainView(tiny_llama()), PrefixScorer)


@pytest.mark.parametrize("kernel", ["math", "flash"])
@pytest.mark.parametrize("prefix", [0, 7])
def test_score_at_equals_score_gathered_with_its_gradients(prefix, kernel, monkeypatch):
    """Both SDPA kernels ``score_at`` picks between on a CPU (the plain one up to ``_MATH_ATTENTION_PAIRS`` query-key
    pairs per head, the flash one beyond) give ``score``'s outputs and gradients."""
    import sara.policies.hf as hf

    monkeypatch.setattr(hf, "_MATH_ATTENTION_PAIRS", 1 << 40 if kernel == "math" else 0)
    pol = tiny_llama(value_head=True)
    batch, at = scored_batch()
    assert_score_at_equals_score(pol, batch, at, prefix)
    with pytest.raises(ValueError, match="prefix"):
        pol.score_at(batch, at, prefix_len=8)  # row 0's prompt is 8 tokens: its first response token is scored at 8


def scored_batch(n: int = 6, seed: int = 1):
    """``n`` rows sharing a 7-token prefix, then a question of 1-3 tokens and a completion of 1-5 (right padding),
    and ``at [n, R]``, each row's response positions (clamped to the last column)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (7,), generator=gen).tolist()
    rows = [(shared + torch.randint(3, VOCAB, (1 + i % 3,), generator=gen).tolist(),
             torch.randint(3, VOCAB, (1 + (2 * i) % 5,), generator=gen).tolist()) for i in range(n)]
    t, r = max(len(q) + len(a) for q, a in rows), max(len(a) for _, a in rows)
    ids, att, resp = (torch.zeros(n, t, dtype=torch.long) for _ in range(3))
    at = torch.zeros(n, r, dtype=torch.long)
    for i, (q, a) in enumerate(rows):  # right padding, prompts and completions of different lengths
        ids[i, : len(q) + len(a)] = torch.tensor(q + a)
        att[i, : len(q) + len(a)] = 1
        resp[i, len(q): len(q) + len(a)] = 1
        at[i] = (len(q) + torch.arange(r)).clamp(max=t - 1)
    return TokenBatch(ids, att, resp), at


def assert_score_at_equals_score(pol, batch, at, prefix):
    """``score_at``'s log-probs, entropies, values and parameter gradients equal ``score``'s gathered at ``at``."""
    valid = batch.response_mask.gather(1, at) > 0
    weights = torch.randn(at.shape, generator=torch.Generator().manual_seed(2))

    def run(fn):
        pol.model.zero_grad(set_to_none=True)
        pol.value_head.zero_grad(set_to_none=True)
        out = fn()
        ((out.logprobs + out.entropy + out.values) * weights * valid).sum().backward()
        return out, [p.grad.clone() for p in pol.parameters()]

    ref, ref_grads = run(lambda: _gathered(pol.score(batch, with_entropy=True, with_values=True), at))
    got, got_grads = run(lambda: pol.score_at(batch, at, prefix_len=prefix, with_entropy=True, with_values=True))
    for name in ("logprobs", "entropy", "values"):
        torch.testing.assert_close(getattr(got, name)[valid], getattr(ref, name)[valid], rtol=1e-5, atol=1e-5)
    for g, h in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, h, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # without a graph the chunks run as they are: the same outputs
        plain = pol.score_at(batch, at, prefix_len=prefix, with_entropy=True)
    torch.testing.assert_close(plain.logprobs, got.logprobs, rtol=0, atol=0)
    torch.testing.assert_close(plain.entropy, got.entropy, rtol=0, atol=0)


def _gathered(out, at):
    return type(out)(*(None if x is None else x.gather(1, at) for x in (out.logprobs, out.entropy, out.values)))


@pytest.mark.parametrize("chunk", [1, 4, 5, 17, 1000])
def test_the_chunked_vocabulary_projection_equals_the_unchunked_math_with_its_gradients(chunk):
    """``token_logprobs`` in chunks (smaller than ``K = 17``, not dividing it, equal to it, larger) gives the
    log-probs, entropies and gradients (hidden states and head weight) of one ``[K, V]`` float32 softmax, soft cap
    and temperature included."""
    from sara.policies.vocab import chunk_rows, token_logprobs

    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(32, VOCAB, bias=False)
    h0, targets = torch.randn(17, 32, generator=gen), torch.randint(0, VOCAB, (17,), generator=gen)
    w_lp, w_ent = torch.randn(17, generator=gen), torch.randn(17, generator=gen)

    def finish(x):
        return torch.tanh(x / 3.0) * 3.0 / 0.7

    def run(fn):
        head.zero_grad(set_to_none=True)
        h = h0.clone().requires_grad_(True)
        lp, ent = fn(h)
        ((lp * w_lp) + (ent * w_ent)).sum().backward()
        return lp, ent, h.grad, head.weight.grad.clone()

    def unchunked(h):
        logits = finish(head(h).float())
        logz = torch.logsumexp(logits, dim=-1)
        lp = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
        return lp, logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)

    ref = run(unchunked)
    got = run(lambda h: token_logprobs(h, targets, head, finish, with_entropy=True, chunk=chunk))
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    lp, ent = token_logprobs(h0, targets, head, finish)  # the default chunk; no entropy unless asked
    torch.testing.assert_close(lp, ref[0], rtol=1e-6, atol=1e-6)
    assert ent is None and chunk_rows(49152) == 170 and chunk_rows(1 << 30) == 1


@pytest.mark.parametrize("chunk", [1, 5, 24, 1000])
def test_score_at_in_chunks_equals_score_gathered(chunk):
    pol = tiny_llama(value_head=True, temperature=0.7)
    pol.vocab_chunk = chunk
    batch, at = scored_batch(n=8)
    k = int((batch.response_mask.gather(1, at) > 0).sum())
    assert k == 24  # chunks smaller than K, not dividing it, equal to it, and larger
    assert_score_at_equals_score(pol, batch, at, prefix=7)


def test_score_at_neither_keeps_nor_makes_a_tensor_over_every_scored_position_and_the_vocabulary():
    """With ``vocab_chunk = C < K``: no tensor saved for the backward, and none made in the forward or the backward,
    has more than ``C`` rows of ``V`` columns (the ``[K, V]`` logits are never whole)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    pol, chunk = tiny_llama(), 4
    pol.vocab_chunk = chunk
    batch, at = scored_batch(n=8)
    k = int((batch.response_mask.gather(1, at) > 0).sum())
    saved: list[tuple[int, ...]] = []
    made: list[tuple[int, ...]] = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            made.extend(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                        if isinstance(t, torch.Tensor))
            return out

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with Shapes():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = pol.score_at(batch, at, prefix_len=7, with_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()

    def vocab_rows(shapes):  # rows of V entries in each tensor with a V dimension, the head's weight (and its
        # transpose, its gradient) aside
        return [int(np.prod(s)) // VOCAB for s in shapes if VOCAB in s and s not in ((VOCAB, 32), (32, VOCAB))]

    assert k > 2 * chunk and vocab_rows(made)  # the chunks' logits are made, a chunk at a time
    assert max(vocab_rows(saved), default=0) <= chunk, saved
    assert max(vocab_rows(made)) <= chunk, made


@pytest.mark.parametrize("algo", ["grpo", "grpo:loss_agg_mode=seq-mean-token-mean,drop_zero_adv_groups=true",
                                  "dr_grpo", "grpo:entropy_coef=0.01,loss_agg_mode=seq-mean-token-sum"])
def test_the_fast_update_equals_the_plain_one_forward_update(algo):
    # Three distinct prefixes in one batch, a budget that forces several micro-batches: the accumulated gradient and
    # the metrics equal one plain forward over the whole batch.
    spec = make_algo(algo)
    pol = tiny_llama()
    b = make_batch(prefixed_groups())
    fast = Learner(pol, spec, OptimConfig(lr=1e-3, microbatch_tokens=40), seed=0)
    plan = fast._plan(b)
    assert len(plan) >= 3 and len({m.prefix for m in plan if m.prefix}) >= 2  # several micro-batches and prefixes
    plain = Learner(PlainView(pol), spec, OptimConfig(lr=1e-3, microbatch_tokens=None), seed=0)
    assert len(plain._plan(b)) == 1 and plain._plan(b)[0].prefix == 0
    assert_same_step(captured_step(fast, b), captured_step(plain, b))


@pytest.mark.parametrize("algo, optim", [("ppo", {"minibatch_rollouts": 7, "epochs": 2}),
                                         ("grpo:kl_mode=loss,kl_coef=0.1", {"minibatch_rollouts": 9})])
def test_micro_batches_equal_one_forward_with_a_critic_a_reference_and_mini_batches(algo, optim):
    spec = make_algo(algo)
    pol = tiny_llama(value_head=spec.needs_critic)
    b = make_batch(prefixed_groups(seed=3))
    # a small lr keeps the two runs' later mini-batches on the same weights (up to rounding)
    fast = Learner(pol, spec, OptimConfig(lr=1e-7, microbatch_tokens=30, **optim), seed=0)
    plain = Learner(PlainView(pol), spec, OptimConfig(lr=1e-7, microbatch_tokens=None, **optim), seed=0)
    assert (fast.reference is None) == (plain.reference is None) == (not spec.needs_reference)
    assert_same_step(captured_step(fast, b), captured_step(plain, b))


def test_the_tiny_policys_plain_path_accumulates_micro_batches_exactly():
    pol = TinyPolicy({"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 32, "alphabet": "0123456789+=abcdefgh"})
    groups = prefixed_groups(seed=5, vocab=pol.tokenizer.vocab_size, lo=1)
    b = make_batch(groups)
    spec = make_algo("grpo:loss_agg_mode=seq-mean-token-sum-norm")
    small = Learner(pol, spec, OptimConfig(lr=1e-3, microbatch_tokens=16), seed=0)
    whole = Learner(pol, spec, OptimConfig(lr=1e-3, microbatch_tokens=None), seed=0)
    assert len(small._plan(b)) > 3 and all(m.prefix == 0 for m in small._plan(b))
    assert_same_step(captured_step(small, b), captured_step(whole, b))


def test_stale_rows_keep_the_generators_logprobs_on_the_fast_path():
    groups = prefixed_groups()
    old = [dataclasses.replace(r, policy_version=0) for r in groups[1].rollouts]
    groups[1] = dataclasses.replace(groups[1], rollouts=tuple(old))
    b = make_batch(groups, version=1)
    assert b.stale is not None and int(b.stale.sum()) == len(old)
    pol = tiny_llama()
    fast = Learner(pol, make_algo("grpo"), OptimConfig(lr=1e-3, microbatch_tokens=40), seed=0)
    plain = Learner(PlainView(pol), make_algo("grpo"), OptimConfig(lr=1e-3, microbatch_tokens=None), seed=0)
    a, c = captured_step(fast, b, step=1), captured_step(plain, b, step=1)
    assert_same_step(a, c)
    assert a[0]["algo/ppo_kl"] != 0.0  # the stale rows' ratios are not 1 (their old log-probs are the generator's)


def test_the_plan_covers_every_row_once_within_the_budget_with_shared_prefixes():
    b = make_batch(prefixed_groups(n_groups=12))
    prompts = [tuple(b.tokens.input_ids[i, : int(p)].tolist()) for i, p in enumerate(b.prompts())]
    lengths = b.tokens.attention_mask.sum(1).tolist()
    for budget in (None, 400, 60, 25, 5):
        plan = plan_microbatches(prompts, lengths, budget)
        assert sorted(np.concatenate([m.rows for m in plan]).tolist()) == list(range(len(prompts)))
        for m in plan:
            rows = m.rows.tolist()
            assert budget is None or m.tokens <= budget or len(rows) == 1
            assert m.width == max(lengths[i] for i in rows)
            assert all(m.prefix < len(prompts[i]) for i in rows)
            assert len({prompts[i][: m.prefix] for i in rows}) == 1  # the prefix really is shared
    one = plan_microbatches(prompts, lengths, None)
    assert len(one) == 1 and one[0].prefix == 0  # the three preambles share too little (3 tokens) to share at all
    split = plan_microbatches(prompts, lengths, 10_000)
    assert sorted(m.prefix for m in split) == [9, 10, 12]  # one micro-batch per preamble, each sharing it
    assert all(m.prefix == 0 for m in plan_microbatches(prompts, lengths, 60, share=False))


def test_the_cpu_attention_kernel_is_the_plain_one_up_to_the_threshold_and_flash_beyond():
    import contextlib

    import sara.policies.hf as hf

    cpu, limit = torch.device("cpu"), hf._MATH_ATTENTION_PAIRS
    assert not isinstance(hf._attention_kernel(limit, cpu), contextlib.nullcontext)  # the math kernel, forced
    assert isinstance(hf._attention_kernel(limit + 1, cpu), contextlib.nullcontext)  # torch's choice: flash on CPU
    assert isinstance(hf._attention_kernel(1, torch.device("meta")), contextlib.nullcontext)  # never off a CPU


def _chunk_under_autocast(h, targets, head, finish, chunk):
    """The projection as autocast runs it, chunk by chunk (the weight cast in each chunk and each recomputation)."""
    from torch.utils.checkpoint import checkpoint

    def rows(hc, tc):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = head(hc)
        logits = finish(out.float())
        logz = torch.logsumexp(logits, dim=-1)
        return logits.gather(-1, tc[:, None]).squeeze(-1) - logz, logz - (torch.softmax(logits, -1) * logits).sum(-1)

    parts = [checkpoint(rows, hc, tc, use_reentrant=False) for hc, tc in zip(h.split(chunk), targets.split(chunk))]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@pytest.mark.parametrize("bias", [False, True])
def test_a_bfloat16_head_casts_its_weight_once_and_gives_autocasts_numbers(bias):
    """With ``dtype=bfloat16`` the head's float32 weight is cast to bfloat16 once per call (not per chunk and again in
    each recomputation), and the log-probs, entropies and gradients are autocast's, bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sara.policies.vocab import token_logprobs

    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(32, VOCAB, bias=bias)
    h0, targets = torch.randn(17, 32, generator=gen), torch.randint(0, VOCAB, (17,), generator=gen)
    w_lp, w_ent = torch.randn(17, generator=gen), torch.randn(17, generator=gen)

    def finish(x):
        return x / 0.7

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].shape == head.weight.shape \
                    and args[0].dtype == torch.float32 and out.dtype == torch.bfloat16:
                self.n += 1
            return out

    def run(fn):
        head.zero_grad(set_to_none=True)
        h = h0.clone().requires_grad_(True)
        with Casts() as casts:
            lp, ent = fn(h)
            ((lp * w_lp) + (ent * w_ent)).sum().backward()
        grads = [h.grad, head.weight.grad.clone()] + ([head.bias.grad.clone()] if bias else [])
        return [lp, ent, *grads], casts.n

    ref, ref_casts = run(lambda h: _chunk_under_autocast(h, targets, head, finish, 5))
    got, got_casts = run(lambda h: token_logprobs(h, targets, head, finish, dtype=torch.bfloat16, with_entropy=True,
                                                  chunk=5))
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)
    assert ref_casts == 8 and got_casts == 1  # 4 chunks, forward and recomputation; one copy


def test_a_head_with_its_own_forward_runs_as_it_is():
    from sara.policies.vocab import token_logprobs

    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2.0 * super().forward(x)

    gen = torch.Generator().manual_seed(2)
    head = Scaled(32, VOCAB, bias=False)
    h, targets = torch.randn(9, 32, generator=gen), torch.randint(0, VOCAB, (9,), generator=gen)
    lp, _ = token_logprobs(h, targets, head, lambda x: x, dtype=torch.bfloat16, chunk=4)
    ref, _ = _chunk_under_autocast(h, targets, head, lambda x: x, 4)
    assert torch.equal(lp, ref)
