"""``sara.hf_kernels``: a grouped-query model switched to ``GROUPED_SDPA`` computes what transformers' ``sdpa`` computes
(forward, gradients, a decode over a KV cache, left padding) without copying its keys / values per query head; models
it does not apply to are left alone, and the HF policy and backend load with it."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from sara.hf_kernels import GROUPED_SDPA, group_attention  # noqa: E402

pytestmark = pytest.mark.isa  # results depend on the CPU's kernels: .ci/run runs these under AVX2 too


def _llama(kv_heads: int = 2, attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=128, attn_implementation=attn)
    return LlamaForCausalLM(cfg).float()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    attn = torch.ones_like(ids)
    attn[0, :5] = 0  # left padding, so every call has a mask (where sdpa repeats the keys)
    attn[1, :2] = 0
    return ids, attn


def test_the_grouped_model_computes_what_sdpa_computes_with_its_gradients():
    plain = _llama()
    grouped = copy.deepcopy(plain)
    assert group_attention(grouped) and grouped.config._attn_implementation == GROUPED_SDPA
    ids, attn = _batch()
    outs = []
    for m in (plain, grouped):
        logits = m(input_ids=ids, attention_mask=attn).logits
        logits[attn.bool()].logsumexp(-1).sum().backward()
        outs.append(logits.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(plain.named_parameters(), grouped.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_decode_over_the_cache_gives_the_same_tokens_and_logits():
    plain = _llama().eval()
    grouped = copy.deepcopy(plain)
    group_attention(grouped)
    ids, attn = _batch()
    with torch.no_grad():
        a = plain.generate(input_ids=ids, attention_mask=attn, max_new_tokens=6, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        b = grouped.generate(input_ids=ids, attention_mask=attn, max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_no_key_is_repeated_per_query_head(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa

    calls = []
    real = sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda *a: calls.append(1) or real(*a))
    ids, attn = _batch()
    plain = _llama()
    grouped = copy.deepcopy(plain)
    group_attention(grouped)
    with torch.no_grad():
        grouped(input_ids=ids, attention_mask=attn)
        assert calls == []
        plain(input_ids=ids, attention_mask=attn)  # the control: sdpa copies them for a masked call
    assert calls


@pytest.mark.parametrize("kv_heads, attn", [(4, "sdpa"), (2, "eager")])
def test_other_models_are_left_alone(kv_heads, attn):
    model = _llama(kv_heads, attn)
    assert not group_attention(model) and model.config._attn_implementation == attn


@pytest.mark.hf
def test_the_hf_policy_and_backend_load_with_it(tiny_model_dir):
    from sara.backends.hf import HFBackend
    from sara.policies.hf import HFPolicy

    policy = HFPolicy(str(tiny_model_dir), compute_dtype="float32")
    backend = HFBackend(str(tiny_model_dir), dtype="float32")
    try:
        for model in (policy.model, backend.model):  # the tiny model groups 4 query heads over 2 key / value heads
            assert model.config._attn_implementation == GROUPED_SDPA
    finally:
        backend.close()
