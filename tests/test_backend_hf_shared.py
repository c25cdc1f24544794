"""Shared-prefix prefill (``sara.backends.hf_shared``) on a tiny random float32 Llama: prompts with a common few-shot
prefix give the logits, KV layout and completions of a plain prefill, in rounds and in the streaming loop, the
prefix is prefilled once and reused across calls, never across weight versions, and prompts without a long enough
common prefix are prefilled whole."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the HF backend needs torch")
pytest.importorskip("transformers", reason="the HF backend needs transformers")

from sara.envs.base import GenerationRequest, SamplingConfig  # noqa: E402

SHOTS = "Examples: 8+2=10\n3+4=7\n6+1=7\n5+5=10\nNow: "
QUESTIONS = ["1+1=", "12+30=", "7+8=", "2+2= (short)"]
SAMPLING = SamplingConfig(max_new_tokens=6)


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    """Same float32 weights: shared-prefix prefill on (no prompt-KV cache, so every prefill runs) and off."""
    from sara.backends.hf import HFBackend

    on = HFBackend(str(tiny_model_dir), dtype="float32", max_batch_size=8, prefix_cache_tokens=0, shared_prefix_tokens=4)
    off = HFBackend(str(tiny_model_dir), dtype="float32", max_batch_size=8, prefix_cache_tokens=0, shared_prefix_tokens=0)
    yield on, off
    on.close()
    off.close()


def _ids(b, texts):
    from sara.backends.text import encode_prompt

    return [encode_prompt(b.tokenizer, t) for t in texts]


def test_prefill_matches_a_plain_prefill(pair):
    on, off = pair
    on.reset_prefix_cache()
    prompts = _ids(on, [SHOTS + q for q in QUESTIONS])
    assert len({len(p) for p in prompts}) > 1  # suffixes of different lengths
    p0 = on.shared_prefix.prefills
    logits, cache, mask = on._prefill_batch(prompts)
    assert on.shared_prefix.prefills == p0 + 1
    ref_logits, ref_cache, ref_mask = off._prefill_batch(prompts)
    assert torch.equal(mask, ref_mask)  # the same left-padded layout
    assert torch.allclose(logits, ref_logits, atol=1e-4)
    real = mask.bool()[:, None, :, None]
    for got, ref in zip(cache.layers, ref_cache.layers):
        assert torch.allclose(got.keys * real, ref.keys * real, atol=1e-4)
        assert torch.allclose(got.values * real, ref.values * real, atol=1e-4)


def test_completions_match_in_rounds_and_streaming_and_the_prefix_is_reused(pair):
    on, off = pair
    on.reset_prefix_cache()
    reqs = [GenerationRequest(prompt=SHOTS + q, seeds=(3 + i, 40 + i)) for i, q in enumerate(QUESTIONS)]
    p0, h0 = on.shared_prefix.prefills, on.shared_prefix.hits
    got = on.generate(reqs, SAMPLING)
    ref = off.generate(reqs, SAMPLING)
    assert [[c.token_ids for c in o] for o in got] == [[c.token_ids for c in o] for o in ref]
    assert (on.shared_prefix.prefills - p0, on.shared_prefix.hits - h0) == (1, 0)
    # streaming: admissions of one prompt at a time reuse the prefix kept from the round
    on.submit([(i, GenerationRequest(prompt=r.prompt, seeds=(r.seeds[0],))) for i, r in enumerate(reqs)], SAMPLING)
    done = {}
    while on.inflight():
        done.update(on.poll())
    assert [done[i].token_ids for i in range(len(reqs))] == [o[0].token_ids for o in ref]
    assert on.shared_prefix.prefills - p0 == 1 and on.shared_prefix.hits - h0 >= 1


def test_weights_update_drops_the_prefix_and_unrelated_prompts_prefill_whole(pair, tiny_model_dir):
    on, off = pair
    on.reset_prefix_cache()
    on._prefill_batch(_ids(on, [SHOTS + q for q in QUESTIONS[:2]]))
    assert len(on.shared_prefix._kv) == 1
    on.update_weights({k: v.clone() for k, v in on.model.state_dict().items()}, version=on.version + 1)
    assert len(on.shared_prefix._kv) == 0  # a prefix never outlives its weights
    on._prefill_batch(_ids(on, [SHOTS + q for q in QUESTIONS[1:3]]))  # they differ from their first digit on
    assert on.shared_prefix.prefill(on, _ids(on, [SHOTS + "3+3="])) is not None  # one prompt: the kept prefix
    on.version += 1  # a version change the cache was not told of
    assert on.shared_prefix.prefill(on, _ids(on, [SHOTS + "3+3="])) is None and not on.shared_prefix._kv
    before = on.shared_prefix.prefills
    assert on.shared_prefix.prefill(on, _ids(on, ["Hello there", "Goodbye now"])) is None  # nothing shared
    assert on.shared_prefix.prefill(on, _ids(on, [SHOTS + "1+1="])) is None  # one prompt, nothing kept yet
    assert on.shared_prefix.prefills == before
    reqs = [GenerationRequest(prompt=p, seeds=(1,)) for p in ("Hello there", "Goodbye now", SHOTS + "9+9=")]
    assert [o[0].token_ids for o in on.generate(reqs, SAMPLING)] == [o[0].token_ids for o in off.generate(reqs, SAMPLING)]


def test_a_longer_common_prefix_replaces_a_short_kept_one(pair):
    on, off = pair
    on.reset_prefix_cache()
    # a short prefix shared by all (like a chat header), then two different shot sets
    header = "Answer briefly and exactly, in digits only, please. "
    mixed = _ids(on, [header + "Pets: cat dog", header + SHOTS + "1+1="])
    on._prefill_batch(mixed)
    (short,) = on.shared_prefix._kv
    p0, h0 = on.shared_prefix.prefills, on.shared_prefix.hits
    batch = _ids(on, [header + SHOTS + q for q in QUESTIONS[1:3]])
    logits, _, _ = on._prefill_batch(batch)
    assert (on.shared_prefix.prefills - p0, on.shared_prefix.hits - h0) == (1, 0)
    assert max(len(p) for p in on.shared_prefix._kv) > len(short) + on.shared_prefix.min_tokens - 1
    assert torch.allclose(logits, off._prefill_batch(batch)[0], atol=1e-4)
    on._prefill_batch(_ids(on, [header + SHOTS + "4+4=", header + SHOTS + "5+6="]))  # reuses the longer one
    assert (on.shared_prefix.prefills - p0, on.shared_prefix.hits - h0) == (1, 1)


def test_a_batch_of_prompt_families_prefills_each_through_its_own_prefix(pair):
    """A mixture's batch: two few-shot families (no prefix common to all) and a prompt of neither, interleaved."""
    on, off = pair
    on.reset_prefix_cache()
    other = "Subtract: 9-2=7\n8-5=3\n7-7=0\nNow: "
    texts = [SHOTS + QUESTIONS[0], other + "5-1=", "Unrelated prompt", SHOTS + QUESTIONS[1], other + "10-3=",
             SHOTS + QUESTIONS[2], other + "6-6="]
    prompts = _ids(on, texts)
    p0 = on.shared_prefix.prefills
    logits, cache, mask = on._prefill_batch(prompts)
    assert on.shared_prefix.prefills == p0 + 2  # one prefix per family, none for the lone prompt
    ref_logits, ref_cache, ref_mask = off._prefill_batch(prompts)
    assert torch.equal(mask, ref_mask)
    assert torch.allclose(logits, ref_logits, atol=1e-4)
    real = mask.bool()[:, None, :, None]
    for got, ref in zip(cache.layers, ref_cache.layers):
        assert torch.allclose(got.keys * real, ref.keys * real, atol=1e-4)
        assert torch.allclose(got.values * real, ref.values * real, atol=1e-4)
    reqs = [GenerationRequest(prompt=t, seeds=(5 + i,)) for i, t in enumerate(texts)]
    assert [o[0].token_ids for o in on.generate(reqs, SAMPLING)] == [o[0].token_ids for o in off.generate(reqs, SAMPLING)]


def test_option_is_validated():
    from sara.backends.hf import HFBackendConfig
    from sara.backends.hf_shared import SharedPrefixes
    from sara.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="shared_prefix_tokens"):
        HFBackendConfig(shared_prefix_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SharedPrefixes(0)
