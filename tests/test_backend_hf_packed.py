"""The HF backend's packed bfloat16 linears (``sara.backends.hf_packed``): the same numbers as ``nn.Linear``, packed
once per weights version, only in a copy the backend owns, and the same completions as the unpacked engine."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sara.backends.hf_packed import PackedLinear, _packs_bf16, can_pack, pack_linears  # noqa: E402

pytestmark = pytest.mark.isa  # which CPUs pack bfloat16 depends on the kernels: .ci/run runs these under AVX2 too
needs_packing = pytest.mark.skipif(not _packs_bf16(), reason="oneDNN does not pack bfloat16 weights on this CPU")


def linear(bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(48, 80, bias=bias).to(torch.bfloat16).requires_grad_(False)


@needs_packing
@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (64, 48), (3, 5, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_linear_gives_the_plain_linears_numbers(shape, bias):
    plain = linear(bias)
    packed = PackedLinear(plain, batch_hint=16)
    x = torch.randn(*shape).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), plain(x))
    assert packed.packs == 1 and packed.weight is plain.weight and packed.bias is plain.bias


@needs_packing
def test_it_packs_again_when_its_weight_changes_in_place_and_only_then():
    plain = linear()
    packed = PackedLinear(plain, batch_hint=4)
    x = torch.randn(4, 48).to(torch.bfloat16)
    with torch.inference_mode():
        before = packed(x)
        packed(x)
        assert packed.packs == 1
    with torch.no_grad():  # what load_state_dict does: an in-place copy
        plain.weight.copy_(torch.randn(80, 48).to(torch.bfloat16))
    with torch.inference_mode():
        after = packed(x)
        assert packed.packs == 2 and torch.equal(after, plain(x)) and not torch.equal(after, before)


@needs_packing
def test_a_forward_that_needs_a_gradient_runs_the_plain_linear():
    plain = linear().requires_grad_(True)
    packed = PackedLinear(plain, batch_hint=4)
    out = packed(torch.randn(4, 48).to(torch.bfloat16))
    assert out.requires_grad and packed.packs == 0
    out.float().sum().backward()
    assert plain.weight.grad is not None


def test_float32_weights_are_not_packed():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert not can_pack(module) and pack_linears(module) == 0
    assert type(module[0]) is torch.nn.Linear


@pytest.mark.hf
@needs_packing
def test_the_backend_packs_its_own_copy_never_a_handed_module_and_generates_the_same(tiny_model_dir):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sara.backends.hf import HFBackend, make_hf_backend
    from sara.envs.base import GenerationRequest, SamplingConfig
    from sara.policies.hf import HFPolicy

    def packed_layers(module):
        return [m for m in module.modules() if isinstance(m, PackedLinear)]

    reqs = [GenerationRequest(prompt=f"Count to {n}:", seeds=(n, n + 1, n + 2)) for n in range(3)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6)
    packed = HFBackend(model=str(tiny_model_dir), dtype="bfloat16")
    plain = HFBackend(model=str(tiny_model_dir), dtype="bfloat16", packed_linear=False)
    linears = [m for m in plain.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(packed_layers(packed.model)) == len(linears) > 0 and not packed_layers(plain.model)
    assert packed.model.state_dict().keys() == plain.model.state_dict().keys()
    assert packed.model.lm_head.weight is packed.model.get_input_embeddings().weight  # the tie is kept

    def tokens(backend):
        return [[c.token_ids for c in cs] for cs in backend.generate(reqs, sampling)]

    assert tokens(packed) == tokens(plain)
    # a weight sync: the packed copy follows the new weights
    policy = HFPolicy(str(tiny_model_dir))
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    for backend in (packed, plain):
        backend.update_weights(policy.state_dict(), 1)
    assert tokens(packed) == tokens(plain)
    # the trainer releases the packed copies (and prompt KV) when an update starts; the next call packs again
    layers = packed_layers(packed.model)
    before = [m.packs for m in layers]
    packed.release_stale()
    assert all(m._packed is None for m in layers)
    assert tokens(packed) == tokens(plain) and [m.packs for m in layers] == [b + 1 for b in before]
    # a module handed to the backend is used as is; the policy's copy made by the factory is packed
    handed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    HFBackend(handed, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert not packed_layers(handed)
    copy = make_hf_backend(policy, {"dtype": "bfloat16"})
    assert packed_layers(copy.model) and not packed_layers(policy.model)
    assert not packed_layers(make_hf_backend(policy, {"dtype": "bfloat16", "share_policy": True}).model)
