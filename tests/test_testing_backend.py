"""``sara.testing.check_backend`` accepts a backend that gives the trainer what it needs, and fails on each violation."""

from __future__ import annotations

import dataclasses

import pytest

from sara.config import ConfigError
from sara.envs.base import Completion
from sara.testing import check_backend

WEIGHTS = {"bias": 3}


class GoodBackend:
    """Per-seed and pure Python: each completion is a function of (weights, prompt, seed)."""

    per_request_seeds = True

    def __init__(self) -> None:
        self.bias = WEIGHTS["bias"]
        self.version = 0

    def completion(self, prompt, seed, cap):
        n = min(cap, 1 + (seed + self.bias) % 5)
        return Completion(text="x" * n, token_ids=tuple(range(n)), logprobs=(-0.5,) * n,
                          prompt_token_ids=tuple(ord(ch) for ch in prompt), seed=seed,
                          finish_reason="length" if n == cap else "stop", policy_version=self.version)

    def generate(self, requests, sampling):
        return [[self.completion(r.prompt, s, r.max_new_tokens or sampling.max_new_tokens) for s in r.seeds]
                for r in requests]

    def update_weights(self, state_dict, version):
        if version <= self.version:
            raise ValueError("weights version must increase")
        self.bias = int(state_dict["bias"])
        self.version = int(version)

    def close(self):
        pass


class EmptyPromptIds(GoodBackend):
    def completion(self, prompt, seed, cap):
        return dataclasses.replace(super().completion(prompt, seed, cap), prompt_token_ids=())


class MissingTokenIds(GoodBackend):
    def completion(self, prompt, seed, cap):
        return dataclasses.replace(super().completion(prompt, seed, cap), token_ids=None)


class ShortLogprobs(GoodBackend):
    def completion(self, prompt, seed, cap):
        c = super().completion(prompt, seed, cap)
        return dataclasses.replace(c, logprobs=c.logprobs[:-1])


class BrokenAfterUpdate(GoodBackend):
    """Generation fails once weights were loaded (drops the last request's completions)."""

    def generate(self, requests, sampling):
        out = super().generate(requests, sampling)
        return out[:-1] if self.version else out


class IgnoresTheWeights(GoodBackend):
    """``update_weights`` bumps the version but loads something else than the state it was given."""

    def update_weights(self, state_dict, version):
        super().update_weights({"bias": 0}, version)


class KeepsTheVersion(GoodBackend):
    def update_weights(self, state_dict, version):
        self.bias = int(state_dict["bias"])


class StaleMetadata(GoodBackend):
    def completion(self, prompt, seed, cap):
        return dataclasses.replace(super().completion(prompt, seed, cap), policy_version=0)


class OnlyNextVersion(GoodBackend):
    """Refuses the version jump of a resumed run (the trainer reloads its saved version into a fresh backend)."""

    def update_weights(self, state_dict, version):
        if version != self.version + 1:
            raise ValueError(f"expected version {self.version + 1}")
        super().update_weights(state_dict, version)


def test_a_conforming_backend_passes_and_its_weights_are_loaded_twice():
    backend = GoodBackend()
    report = check_backend(backend, state_dict=WEIGHTS)
    assert report == {"completions": 6, "tokens": report["tokens"], "seeded": True, "versions": [1, 3]}
    assert report["tokens"] > 0 and backend.version == 3


@pytest.mark.parametrize("backend, message", [
    (EmptyPromptIds(), "empty prompt_token_ids"),
    (MissingTokenIds(), "token_ids is NoneType"),
    (ShortLogprobs(), "log-probs for .* tokens"),
    (BrokenAfterUpdate(), r"after update_weights\(\.\.\., 1\): generate returned 3 lists for 4 requests"),
    (IgnoresTheWeights(), r"after update_weights\(\.\.\., 1\): request 0 changed its tokens"),
    (KeepsTheVersion(), r"update_weights\(\.\.\., 1\) left backend.version=0"),
    (StaleMetadata(), r"after update_weights\(\.\.\., 1\): request 0 completion 0: generated with weights version 0"),
])
def test_each_violation_of_the_trainer_contract_fails(backend, message):
    with pytest.raises(AssertionError, match=message):
        check_backend(backend, state_dict=WEIGHTS)


def test_a_backend_refusing_a_resumed_version_jump_fails():
    with pytest.raises(ValueError, match="expected version 2"):
        check_backend(OnlyNextVersion(), state_dict=WEIGHTS)


def test_check_backend_needs_the_weights_and_two_prompts():
    with pytest.raises(ConfigError, match="field 'state_dict'"):
        check_backend(GoodBackend())
    with pytest.raises(ConfigError, match="field 'prompts'"):
        check_backend(GoodBackend(), state_dict=WEIGHTS, prompts=("1+1=",))


def test_the_tiny_backend_passes_and_its_logprobs_are_the_policys():
    pytest.importorskip("torch")
    from sara.backends.tiny import make_tiny_backend
    from sara.envs.base import GenerationRequest, SamplingConfig
    from sara.policies.tiny import TinyPolicy
    from sara.testing.backend import logprob_gaps

    policy = TinyPolicy({"d_model": 16, "n_layers": 1, "n_heads": 2})
    backend = make_tiny_backend(policy)
    assert check_backend(backend, state_dict=policy.state_dict())["versions"] == [1, 3]
    # the generator's log-probs are the policy's own (same weights, same float32 math)
    out = backend.generate([GenerationRequest(prompt=p, seeds=(1, 2)) for p in ("1+2=", "30+4=")],
                           SamplingConfig(max_new_tokens=5))
    comps = [c for cs in out for c in cs]
    gaps = logprob_gaps(policy, comps)
    assert len(gaps) == sum(c.num_tokens for c in comps) > 0 and float(gaps.max()) < 1e-4


def test_scripted_backend_is_a_conforming_backend():
    from sara.testing import ScriptedBackend

    class Echo(ScriptedBackend):
        def answer(self, request, seed):
            return f"{seed % 7}"

    backend = Echo()
    check_backend(backend, state_dict={})
    assert backend.version > 0 and backend.calls  # it followed the weight loads and recorded every round
    with pytest.raises(NotImplementedError, match="answer"):
        ScriptedBackend().generate(backend.calls[-1][0], backend.calls[-1][1])
