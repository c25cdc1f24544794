"""The output head of every HF module sara loads reads a row-major input (``sara.hf_kernels.contiguous_head``): a prefill's
last-position view ``hidden[:, -1:, :]`` is strided, and torch's CPU matmul on such a 3-D input with a weight that
needs no grad runs a batched product over a broadcast copy of the weight (hundreds of times slower on SmolLM2)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the HF backend needs torch")
pytest.importorskip("transformers", reason="the HF backend needs transformers")

from sara.envs.base import GenerationRequest, SamplingConfig  # noqa: E402
from sara.hf_kernels import _dense, contiguous_head  # noqa: E402

pytestmark = pytest.mark.hf


def _row_major(x: torch.Tensor) -> bool:
    want, acc = [], 1
    for size in reversed(x.shape):
        want.append(acc)
        acc *= int(size)
    return tuple(x.stride()) == tuple(reversed(want))


def test_dense_copies_only_strided_views():
    h = torch.randn(4, 7, 8)
    last = h[:, -1:, :]
    assert not _row_major(last)
    out = _dense(last)
    assert _row_major(out) and torch.equal(out, last)
    one = torch.randn(1, 7, 8)[:, -1:, :]  # is_contiguous() is True, but its leading stride is 56, not 8
    assert one.is_contiguous() and not _row_major(one)
    assert _row_major(_dense(one)) and torch.equal(_dense(one), one)
    assert _dense(h) is h  # already row-major: no copy
    flat = h[:, -1, :]
    assert _dense(flat) is flat  # 2-D inputs go to a plain matrix product anyway


def _record_head_inputs(module) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    module.get_output_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(args[0]))  # runs after ours
    return seen


def test_generation_heads_read_row_major_inputs(tiny_model_dir):
    from sara.backends.hf import HFBackend, make_hf_backend
    from sara.policies.hf import HFPolicy

    policy = HFPolicy(str(tiny_model_dir), dtype="float32")
    backends = [HFBackend(str(tiny_model_dir), dtype="float32"),  # loaded by name
                make_hf_backend(policy, {"dtype": "bfloat16"})]  # a frozen copy of the policy's module
    shots = "Add the numbers.\n3+4=7\n12+30=42\n5+5=10\n8+1=9\n"  # >= 16 shared tokens: a one-row prefix prefill
    prompts = [shots + "1+1=", shots + "2+5=", "Count: one two three"]
    for backend in backends:
        seen = _record_head_inputs(backend.model)
        backend.generate([GenerationRequest(prompt=p, seeds=(1, 2)) for p in prompts],
                         SamplingConfig(max_new_tokens=3))
        assert seen, "the head was never called"
        assert all(_row_major(x) for x in seen), [tuple(x.stride()) for x in seen]
        assert any(x.shape[0] == 1 for x in seen)  # the shared prefix's one-row prefill went through the head too


def test_contiguous_head_registers_once_and_keeps_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    with torch.inference_mode():
        plain = model(input_ids=ids, logits_to_keep=1).logits
        assert contiguous_head(model) is contiguous_head(model) is model
        assert len(model.get_output_embeddings()._forward_pre_hooks) == 1
        hooked = model(input_ids=ids, logits_to_keep=1).logits
    torch.testing.assert_close(hooked, plain, rtol=0, atol=1e-6)
