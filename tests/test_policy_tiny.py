"""The tiny transformer policy, its tokenizer, warm start and cache, and its generation backend."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sara.backends import BACKENDS  # noqa: E402
from sara.backends.tiny import TinyBackend, make_tiny_backend  # noqa: E402
from sara.envs.base import GenerationBackend, GenerationRequest, SamplingConfig  # noqa: E402
from sara.policies import POLICIES, Policy, TokenBatch  # noqa: E402
from sara.policies.tiny import (  # noqa: E402
    BOS,
    EOS,
    CharTokenizer,
    TinyConfig,
    TinyPolicy,
    WarmStartConfig,
    make_tiny_policy,
    num_parameters,
    warm_start,
)
from sara.types import Prompt  # noqa: E402

SMALL = {"d_model": 32, "n_layers": 1, "n_heads": 2}


def test_tokenizer_roundtrip_and_errors():
    tok = CharTokenizer("0123456789+-=")
    ids = tok.encode("12+3=", bos=True, eos=True)
    assert ids[0] == BOS and ids[-1] == EOS and tok.vocab_size == 16
    assert tok.decode(ids) == "12+3="
    assert tok.decode(tok.encode("45") + [EOS] + tok.encode("9")) == "45"  # stops at EOS
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("1x")
    with pytest.raises(ValueError):
        CharTokenizer("aa")


def test_default_size_and_protocol():
    pol = TinyPolicy()
    assert 300_000 < num_parameters(pol) < 1_000_000  # "a few hundred thousand parameters"
    assert isinstance(pol, Policy) and not pol.has_value_head
    assert TinyPolicy({"value_head": True}).has_value_head
    with pytest.raises(ValueError, match="n_heads"):
        TinyConfig(d_model=30, n_heads=4)


def test_init_is_deterministic_under_seed():
    a, b, c = TinyPolicy(SMALL), TinyPolicy(SMALL), TinyPolicy({**SMALL, "init_seed": 1})
    for (ka, va), (_, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(va, vb), ka
    assert any(not torch.equal(va, vc) for va, vc in zip(a.state_dict().values(), c.state_dict().values()))


def test_token_logprobs_match_a_direct_softmax_and_are_causal():
    pol = TinyPolicy(SMALL)
    ids = torch.tensor([[BOS, 4, 5, 13, 6, EOS], [BOS, 7, 13, 8, 0, 0]])
    batch = TokenBatch(ids, (ids != 0).long(), torch.zeros_like(ids))
    lp, ent = pol.token_logprobs(batch, with_entropy=True)
    assert lp.shape == ids.shape and ent.shape == ids.shape and torch.all(lp[:, 0] == 0)
    logits = pol(ids)
    direct = torch.log_softmax(logits[0, 2], -1)[ids[0, 3]]
    assert torch.allclose(lp[0, 3], direct, atol=1e-5)
    # Right padding never changes earlier positions (causal attention).
    lp_short, _ = pol.token_logprobs(TokenBatch(ids[1:, :4], ids[1:, :4] != 0, ids[1:, :4]))
    assert torch.allclose(lp[1, :4], lp_short[0], atol=1e-5)
    assert torch.all(ent[:, 1:] > 0) and torch.all(ent <= math.log(16) + 1e-4)


def test_values_alignment():
    pol = TinyPolicy({**SMALL, "value_head": True})
    torch.nn.init.normal_(pol.value.weight)
    ids = torch.tensor([[BOS, 4, 5, 6]])
    v = pol.values(TokenBatch(ids, ids != 0, ids))
    assert v.shape == (1, 4) and v[0, 0] == 0
    h = pol.hidden(ids)
    assert torch.allclose(v[0, 2], pol.value(h[0, 1]).squeeze(), atol=1e-6)
    with pytest.raises(RuntimeError, match="value head"):
        TinyPolicy(SMALL).values(TokenBatch(ids, ids, ids))


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(prompt="12+34=", seeds=(1, 2, 3)), GenerationRequest(prompt="5-7=", seeds=(4, 5)),
            GenerationRequest(prompt="123+456=", seeds=(6,), max_new_tokens=2)]


def test_backend_is_batch_independent_and_seeded():
    be = TinyBackend(TinyPolicy(SMALL))
    assert isinstance(be, GenerationBackend)
    sc = SamplingConfig(temperature=1.0, max_new_tokens=6)
    full = be.generate(_requests(), sc)
    assert [len(o) for o in full] == [3, 2, 1]
    # the same requests one by one, and in another order, give the same completions
    single = [be.generate([r], sc)[0] for r in _requests()]
    rev = be.generate(list(reversed(_requests())), sc)[::-1]
    small = TinyBackend(TinyPolicy(SMALL), {"forward_rows": 1}).generate(_requests(), sc)
    for a, b, c, d in zip(full, single, rev, small):
        for x, y, z, w in zip(a, b, c, d):
            assert x.token_ids == y.token_ids == z.token_ids == w.token_ids
            assert np.allclose(x.logprobs, y.logprobs, atol=1e-9)
    c = full[0][0]
    assert len(c.logprobs) == len(c.token_ids) == c.num_tokens and c.prompt_token_ids[0] == BOS
    assert all(lp <= 0 for lp in c.logprobs)
    assert full[2][0].num_tokens <= 2  # per-request cap
    # different seeds give different samples from an untrained (near-uniform) policy
    assert len({o.token_ids for o in full[0]}) > 1


def test_backend_logprobs_equal_trainer_logprobs():
    pol = TinyPolicy(SMALL)
    be = TinyBackend(pol)
    c = be.generate([GenerationRequest(prompt="12+34=", seeds=(7,))], SamplingConfig(max_new_tokens=8))[0][0]
    ids = torch.tensor([list(c.prompt_token_ids) + list(c.token_ids)])
    lp, _ = pol.token_logprobs(TokenBatch(ids, ids != 0, ids))
    n = len(c.prompt_token_ids)
    assert np.allclose(lp[0, n:].tolist(), c.logprobs, atol=1e-5)


def test_sampling_follows_the_distribution():
    """Inverse-CDF sampling from per-row seeds reproduces the model's next-token distribution."""
    pol = TinyPolicy(SMALL)
    with torch.no_grad():
        pol.head.weight.mul_(50.0)  # a peaked distribution
    ids = pol.tokenizer.encode("1+1=", bos=True)
    probs = torch.softmax(pol(torch.tensor([ids]))[0, -1].double(), -1).detach().numpy()
    out = pol.sample([ids] * 4000, list(range(4000)), max_new_tokens=1)
    freq = np.bincount([o[0][0] for o in out], minlength=len(probs)) / 4000
    assert np.abs(freq - probs).max() < 0.03


def test_greedy_and_top_p():
    pol = TinyPolicy(SMALL)
    be = TinyBackend(pol)
    greedy = be.generate([GenerationRequest(prompt="1+1=", seeds=(1, 2, 3))], SamplingConfig(temperature=0.0))[0]
    assert len({c.token_ids for c in greedy}) == 1
    ids = pol.tokenizer.encode("1+1=", bos=True)
    top = int(torch.argmax(pol(torch.tensor([ids]))[0, -1].detach()))
    nucleus = pol.sample([ids] * 50, list(range(50)), top_p=1e-6, max_new_tokens=1)
    assert {o[0][0] for o in nucleus} == {top} and all(abs(o[1][0]) < 1e-9 for o in nucleus)


def test_update_weights_and_close():
    pol = TinyPolicy(SMALL)
    be = make_tiny_backend(pol)
    req = [GenerationRequest(prompt="12+34=", seeds=(1, 2, 3, 4))]
    before = be.generate(req, SamplingConfig())[0]
    other = TinyPolicy({**SMALL, "init_seed": 5})
    be.update_weights(other.state_dict(), 1)
    after = be.generate(req, SamplingConfig())[0]
    assert [c.logprobs for c in before] != [c.logprobs for c in after]
    assert after[0].policy_version == 1
    with pytest.raises(ValueError, match="increase"):
        be.update_weights(other.state_dict(), 1)
    # the backend holds a copy: training the caller's module does not change generation
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    assert [c.logprobs for c in be.generate(req, SamplingConfig())[0]] == [c.logprobs for c in after]
    be.close()
    with pytest.raises(RuntimeError):
        be.generate(req, SamplingConfig())


def test_stop_strings_cut_text_and_tokens():
    be = TinyBackend(TinyPolicy(SMALL))
    req = [GenerationRequest(prompt="1+1=", seeds=tuple(range(20)))]
    plain = be.generate(req, SamplingConfig(max_new_tokens=8))[0]
    stop = be.generate(req, SamplingConfig(max_new_tokens=8, stop=("1",)))[0]
    for a, b in zip(plain, stop):
        if "1" in a.text:
            assert b.text == a.text[: a.text.index("1") + 1] and b.num_tokens == len(b.text)
        else:
            assert b.token_ids == a.token_ids


def _prompts(n: int) -> list[Prompt]:
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 10, n), rng.integers(0, 10, n)
    return [Prompt(id=f"p{i}", prompt=f"{x}+{y}=", answer={"answer": int(x + y)}) for i, (x, y) in enumerate(zip(a, b))]


def test_warm_start_learns_single_digit_addition():
    torch.manual_seed(0)
    pol = TinyPolicy({"d_model": 64, "n_layers": 2, "n_heads": 4})
    prompts = _prompts(60)
    losses = warm_start(pol, prompts, WarmStartConfig(steps=200, batch_size=32, lr=3e-3))
    assert losses[-1] < 0.3 * losses[0]
    be = TinyBackend(pol)
    out = be.generate([GenerationRequest(prompt=p.prompt, seeds=(0,)) for p in prompts],
                      SamplingConfig(temperature=0.0, max_new_tokens=3))
    acc = np.mean([o[0].text == str(p.answer["answer"]) for o, p in zip(out, prompts)])
    assert acc > 0.5  # chance is about 1/13 per character


def test_warm_start_stops_at_its_target_loss():
    """``target_loss`` ends the warm start as soon as the recent mean loss reaches it (the same competence on any
    CPU), and never before; without it every step runs."""
    prompts, cfg = _prompts(60), {"steps": 200, "batch_size": 32, "lr": 3e-3}
    full = warm_start(TinyPolicy({"d_model": 64, "n_layers": 2, "n_heads": 4}), prompts, WarmStartConfig(**cfg))
    assert len(full) == 200
    target = float(np.mean(full[90:100]))  # reached around step 100 on this trajectory
    short = warm_start(TinyPolicy({"d_model": 64, "n_layers": 2, "n_heads": 4}), prompts,
                       WarmStartConfig(**cfg, target_loss=target, loss_window=10))
    assert 10 <= len(short) < 200 and np.mean(short[-10:]) <= target
    assert all(np.mean(short[i - 10:i]) > target for i in range(10, len(short)))  # not a step earlier
    assert short == full[:len(short)]  # the same trajectory, cut
    with pytest.raises(ValueError, match="target_loss"):
        WarmStartConfig(target_loss=0.0)


def test_warm_start_cache_and_value_head(tmp_path, monkeypatch):
    monkeypatch.setenv("SARA_CACHE_DIR", str(tmp_path))
    opts = {**SMALL, "warm_start": {"steps": 3, "batch_size": 8}}
    a = make_tiny_policy(opts, prompts=_prompts(20), cache_key="t")
    files = list((tmp_path / "tiny").glob("warm-*.pt"))
    assert len(files) == 1
    b = make_tiny_policy(opts, prompts=_prompts(20), cache_key="t")  # loaded from the cache
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    v = make_tiny_policy({**opts, "value_head": True}, prompts=_prompts(20), cache_key="t")  # same cache entry
    assert len(list((tmp_path / "tiny").glob("warm-*.pt"))) == 1 and v.has_value_head
    assert torch.equal(v.state_dict()["head.weight"], a.state_dict()["head.weight"])
    make_tiny_policy(opts, prompts=_prompts(20), cache_key="other")
    assert len(list((tmp_path / "tiny").glob("warm-*.pt"))) == 2


def test_registries_resolve_lazily():
    assert "tiny" in POLICIES and "tiny" in BACKENDS
    assert BACKENDS.get("tiny") is make_tiny_backend
    with pytest.raises(TypeError):
        make_tiny_backend(object())
