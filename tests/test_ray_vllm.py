"""A vLLM engine inside a Ray actor: the pool generates a real round and its weight broadcast reaches the engine."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytest.importorskip("torch")
ray = pytest.importorskip("ray")

from sara.envs.base import GenerationRequest, SamplingConfig  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _temp_dir=str(tmp_path_factory.mktemp("ray")), configure_logging=False)
    yield
    ray.shutdown()


def test_vllm_engine_in_a_ray_actor_generates_and_follows_weight_updates(vllm_model_path, ray_cluster):
    from sara.backends.ray import RayRolloutPool
    from sara.hub import load_hf_model

    model, tokenizer = load_hf_model(str(vllm_model_path))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 2+3?", "Name a colour.", "Say hello in French.")]
    reqs = [GenerationRequest(prompt=p, seeds=(7 * i, 7 * i + 1)) for i, p in enumerate(prompts)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    spec = "sara.backends.vllm_factory:make_vllm_backend:model=smollm2,max_model_len=256,cpu_kvcache_space_gb=1"
    with RayRolloutPool(spec, num_workers=1, split_requests=False) as pool:
        out = pool.generate(reqs, sampling)
        (info,) = pool.worker_info()
        assert info["pid"] != os.getpid()
        assert [len(o) for o in out] == [2, 2, 2]
        for req, comps in zip(reqs, out):  # request order kept; each completion answers its own prompt
            for c in comps:
                assert req.prompt in tokenizer.decode(list(c.prompt_token_ids))
                assert 1 <= c.num_tokens <= 12 and len(c.logprobs) == c.num_tokens
                assert all(np.isfinite(lp) and lp <= 0.0 for lp in c.logprobs)
        assert sum(bool(c.text.strip()) for o in out for c in o) >= 3  # real answers
        # The trainer's broadcast (a real state dict) reaches the engine inside the actor and changes its outputs.
        state = {k: v * 0.3 if k == "model.norm.weight" else v for k, v in model.state_dict().items()}
        pool.update_weights(state, version=1)
        assert [w["version"] for w in pool.worker_info()] == [1]
        again = pool.generate(reqs, sampling)
        assert [c.token_ids for o in again for c in o] != [c.token_ids for o in out for c in o]
