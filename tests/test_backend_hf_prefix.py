"""The HF backend's prompt-KV cache (``sara.backends.hf_prefix``) on a tiny random float32 Llama: a cached prefill gives
the completions an uncached one gives, it is consulted across rounds and streaming admissions, it never outlives the
weights it was computed with, and its size bound holds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the HF backend needs torch")
pytest.importorskip("transformers", reason="the HF backend needs transformers")

from sara.envs.base import GenerationRequest, SamplingConfig  # noqa: E402

PROMPTS = ["1+1=", "The quick brown fox jumps over the lazy", "Hi", "Name a color please, any color at all"]
SAMPLING = SamplingConfig(max_new_tokens=8)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """Two backends on the same float32 weights: the prompt-KV cache on (default) and off."""
    from sara.backends.hf import HFBackend

    on = HFBackend(str(tiny_model_dir), dtype="float32", max_batch_size=3)
    off = HFBackend(str(tiny_model_dir), dtype="float32", max_batch_size=3, prefix_cache_tokens=0)
    yield on, off
    on.close()
    off.close()


def _ids(out):
    return [[c.token_ids for c in o] for o in out]


def _logprobs(out):
    return [lp for o in out for c in o for lp in c.logprobs]


def _requests(seed0: int) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=p, seeds=(seed0 + i, seed0 + 10 + i)) for i, p in enumerate(PROMPTS)]


def test_rounds_hit_the_cache_and_match_an_uncached_backend(pair):
    on, off = pair
    assert off.prefix_cache is None and on.prefix_cache is not None
    on.reset_prefix_cache()
    hits, misses = on.prefix_cache.hits, on.prefix_cache.misses
    first = on.generate(_requests(0), SAMPLING)
    assert (on.prefix_cache.hits - hits, on.prefix_cache.misses - misses) == (0, 4)  # four prompts prefilled
    assert len(on.prefix_cache) == 4
    second = on.generate(_requests(100), SAMPLING)  # the next round probes the same prompts: no prefill
    assert (on.prefix_cache.hits - hits, on.prefix_cache.misses - misses) == (4, 4)
    mixed = on.generate([GenerationRequest(prompt="Hello there", seeds=(7,)), *_requests(200)[:2]], SAMPLING)
    assert (on.prefix_cache.hits - hits, on.prefix_cache.misses - misses) == (6, 5)  # a new prompt among cached
    for out, reqs in ((first, _requests(0)), (second, _requests(100)),
                      (mixed, [GenerationRequest(prompt="Hello there", seeds=(7,)), *_requests(200)[:2]])):
        ref = off.generate(reqs, SAMPLING)
        assert _ids(out) == _ids(ref)
        assert _logprobs(out) == pytest.approx(_logprobs(ref), abs=1e-4)


def test_streaming_admissions_hit_the_cache_and_match_generate(pair):
    on, off = pair
    on.reset_prefix_cache()
    items = [(i, GenerationRequest(prompt=PROMPTS[i % 2], seeds=(30 + i,), max_new_tokens=2 + i % 5))
             for i in range(9)]
    misses = on.prefix_cache.misses
    on.submit(items, SAMPLING)  # 3 slots: later rows of the same two prompts join as slots free up
    got = {}
    while on.inflight():
        got.update(dict(on.poll()))
    assert on.prefix_cache.misses - misses == 2  # each prompt prefilled once, over several admissions
    assert on._stream.prefills >= 3
    for tag, req in items:
        assert got[tag].token_ids == off.generate([req], SAMPLING)[0][0].token_ids, tag


def test_update_weights_clears_the_cache(pair):
    """After new weights, a cached prompt is prefilled again: completions follow the new weights."""
    on, off = pair
    reqs = _requests(50)
    on.generate(reqs, SAMPLING)
    assert len(on.prefix_cache) == 4
    state = {k: v.clone() for k, v in on.model.state_dict().items()}
    new = {k: (v * 1.5 if k.endswith("input_layernorm.weight") else v) for k, v in state.items()}
    misses = on.prefix_cache.misses
    on.update_weights(new, on.version + 1)
    off.update_weights(new, off.version + 1)
    assert len(on.prefix_cache) == 0
    after = on.generate(reqs, SAMPLING)
    assert on.prefix_cache.misses - misses == 4
    ref = off.generate(reqs, SAMPLING)
    assert _logprobs(after) == pytest.approx(_logprobs(ref), abs=1e-4)
    stale = on.prefix_cache  # a version change without update_weights' reset also starts from an empty cache
    stale.version = -1
    on.generate(reqs[:1], SAMPLING)
    assert len(stale) == 1 and stale.version == on.version
    on.update_weights(state, on.version + 1)
    off.update_weights(state, off.version + 1)


def test_lru_bound_in_tokens(pair):
    from sara.backends.hf_prefix import PromptKVCache
    from sara.backends.text import encode_prompt

    on, _ = pair
    lengths = [len(encode_prompt(on.tokenizer, p)) for p in PROMPTS]
    cache = PromptKVCache(max_tokens=lengths[0] + lengths[2] + 1)
    cache.prefill(on, [encode_prompt(on.tokenizer, p) for p in PROMPTS[:1]])
    cache.prefill(on, [encode_prompt(on.tokenizer, PROMPTS[2])])
    assert len(cache) == 2 and cache.tokens == lengths[0] + lengths[2]
    cache.prefill(on, [encode_prompt(on.tokenizer, PROMPTS[0])])  # a hit refreshes PROMPTS[0]
    cache.prefill(on, [encode_prompt(on.tokenizer, PROMPTS[1])])  # longer than the bound: served, not stored
    assert len(cache) == 2 and cache.hits == 1
    cache.prefill(on, [encode_prompt(on.tokenizer, "a b")])  # evicts the least recently used: PROMPTS[2]
    assert cache.tokens <= cache.max_tokens
    keys = list(cache._entries)
    assert tuple(encode_prompt(on.tokenizer, PROMPTS[2])) not in keys
    assert tuple(encode_prompt(on.tokenizer, PROMPTS[0])) in keys
    with pytest.raises(ValueError, match="max_tokens"):
        PromptKVCache(0)


def test_duplicate_prompts_in_one_call(pair):
    """The same prompt twice in one prefill call (cached or not) gives two identical rows."""
    from sara.backends.text import encode_prompt

    on, _ = pair
    on.reset_prefix_cache()
    ids = [encode_prompt(on.tokenizer, p) for p in (PROMPTS[0], PROMPTS[3], PROMPTS[0])]
    logits, cache, mask = on._prefill(ids)
    assert torch.equal(logits[0], logits[2]) and torch.equal(mask[0], mask[2])
    ref_logits, _, ref_mask = on._prefill_batch(ids)
    assert torch.allclose(logits, ref_logits, atol=1e-5) and torch.equal(mask, ref_mask)
    assert torch.allclose(cache.layers[0].keys[0], cache.layers[0].keys[2])
