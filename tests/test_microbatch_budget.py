"""``optim.microbatch_tokens: auto``: the learner's micro-batch budget sized from what a position's activations take
(the policy's ``SizesActivations``) and the memory the process may use; the estimate against the bytes a real
forward keeps for its backward; the config's bounds; what ``sara train`` prints."""

from __future__ import annotations

import pytest
import torch

from sara.algos import make_algo
from sara.config import ConfigError, validate_config
from sara.memory import device_memory_bytes, machine_memory_bytes
from sara.policies.base import SizesActivations, TokenBatch
from sara.policies.hf import HFPolicy, HFPolicyConfig, decoder_activation_bytes
from sara.train import Learner, OptimConfig
from sara.train.microbatch import (
    ACTIVATION_SHARE,
    FALLBACK_MICROBATCH_TOKENS,
    MIN_AUTO_MICROBATCH_TOKENS,
    microbatch_budget,
    microbatch_line,
)

GiB = 2**30


def test_auto_divides_the_memory_share_by_a_positions_activations():
    assert microbatch_budget("auto", 2**20, 24 * GiB) == (1024, "auto: 1.00 MiB of activations a position, 1/24 of "
                                                                 "24.0 GiB")
    assert microbatch_budget("auto", 2**20, 48 * GiB)[0] == 2048  # twice the memory, twice the positions
    assert microbatch_budget("auto", 2**21, 24 * GiB)[0] == 512  # twice the activations, half the positions
    assert microbatch_budget("auto", 2**30, GiB)[0] == MIN_AUTO_MICROBATCH_TOKENS  # never below the floor
    assert ACTIVATION_SHARE == 24


@pytest.mark.parametrize(("per_token", "memory", "why"), [
    (None, 24 * GiB, "auto: the policy does not say"), (0, 24 * GiB, "auto: the policy does not say"),
    (2**20, None, "auto: this machine's memory is unknown"), (2**20, 0, "auto: this machine's memory is unknown")])
def test_auto_falls_back_when_activations_or_memory_are_unknown(per_token, memory, why):
    """The fallback, and a reason that names what was unknown."""
    tokens, reason = microbatch_budget("auto", per_token, memory)
    assert tokens == FALLBACK_MICROBATCH_TOKENS and reason.startswith(why)


def test_a_number_or_null_is_kept_as_given():
    assert microbatch_budget(300, 2**20, 24 * GiB) == (300, "set in the config")
    assert microbatch_budget(None, 2**20, 24 * GiB)[0] is None
    assert microbatch_line(963, "auto: x") == "learner micro-batches: at most 963 positions (auto: x)"
    assert microbatch_line(None, "one forward per mini-batch").endswith("one forward per mini-batch")


@pytest.mark.parametrize("value", ["big", 0, -3, 2.5, True, 2**31])
def test_the_config_refuses_anything_but_positions_auto_or_null_in_one_line(value):
    with pytest.raises(ConfigError) as err:
        validate_config(OptimConfig, {"microbatch_tokens": value}, what="optim")
    msg = str(err.value)
    assert msg.count("field 'microbatch_tokens'") == 1 and "auto" in msg and "\n" not in msg


def test_the_config_default_is_auto_and_takes_numbers_as_text():
    assert OptimConfig().microbatch_tokens == "auto"
    assert validate_config(OptimConfig, {"microbatch_tokens": "300"}, what="optim").microbatch_tokens == 300


def test_the_memory_the_process_may_use_is_known_here():
    total = machine_memory_bytes()
    assert total is None or total > 2**28
    assert device_memory_bytes("cpu") == total


def _llama(hidden: int = 256, intermediate: int = 640, layers: int = 3, **options) -> HFPolicy:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return HFPolicy(LlamaForCausalLM(cfg), tokenizer=object(), **options)


def _kept_bytes(policy: HFPolicy, rows: int, width: int) -> int:
    """Bytes of the tensors a training forward of ``rows x width`` positions keeps for its backward (parameters and
    their copies under autocast excluded)."""
    params = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params and not (t.dim() == 2 and tuple(t.shape) in policy_shapes):
            kept[s.data_ptr()] = s.nbytes()
        return t

    policy_shapes = {tuple(p.shape) for p in policy.parameters()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    at = torch.arange(1, width).repeat(rows, 1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy.score_at(TokenBatch(ids, mask, mask), at)
    return sum(kept.values())


@pytest.mark.slow
def test_the_estimate_is_within_a_third_of_what_a_float32_forward_keeps():
    policy = _llama(compute_dtype="float32")
    assert isinstance(policy, SizesActivations)
    rows, width = 4, 96
    kept = _kept_bytes(policy, rows, width) / (rows * width)
    estimate = policy.activation_bytes_per_token()
    assert estimate == decoder_activation_bytes(256, 640, 3, half=False)
    assert 0.67 < estimate / kept < 1.5, (estimate, kept)


def test_checkpointing_and_half_precision_lower_the_estimate():
    full = decoder_activation_bytes(576, 1536, 30, half=False)
    assert decoder_activation_bytes(576, 1536, 30, half=True) < full
    assert decoder_activation_bytes(576, 1536, 30, half=False, checkpointing=True) < full / 10


def test_the_config_reads_the_same_estimate_as_the_loaded_model(tiny_model_dir):
    for options in ({"compute_dtype": "float32"}, {"compute_dtype": "float32", "gradient_checkpointing": True}):
        cfg = HFPolicyConfig(model=str(tiny_model_dir), **options)
        assert cfg.activation_bytes_per_token() == HFPolicy(str(tiny_model_dir), **options).activation_bytes_per_token()
    assert HFPolicyConfig(model=str(tiny_model_dir / "missing")).activation_bytes_per_token() is None


def test_the_learner_sizes_its_micro_batches_from_the_policy_and_the_memory(monkeypatch):
    import sara.train.learner as learner_module

    policy = _llama(compute_dtype="float32")
    per_token = policy.activation_bytes_per_token()
    learner = Learner(policy, make_algo("grpo"), OptimConfig(lr=1e-5))
    assert learner.microbatch_tokens == microbatch_budget("auto", per_token, device_memory_bytes("cpu"))[0]
    monkeypatch.setattr(learner_module, "device_memory_bytes", lambda device: 24 * per_token * 300)
    small = Learner(policy, make_algo("grpo"), OptimConfig(lr=1e-5))
    assert small.microbatch_tokens == 300 and "1/24" in small.microbatch_reason
    fixed = Learner(policy, make_algo("grpo"), OptimConfig(lr=1e-5, microbatch_tokens=77))
    assert fixed.microbatch_tokens == 77


def test_a_policy_that_does_not_size_its_activations_gets_the_fallback():
    from sara.policies.tiny import make_tiny_policy

    policy = make_tiny_policy({})
    assert not isinstance(policy, SizesActivations)
    assert Learner(policy, make_algo("grpo"), OptimConfig(lr=1e-3)).microbatch_tokens == FALLBACK_MICROBATCH_TOKENS


def test_the_budget_bounds_the_plan(monkeypatch):
    """A smaller machine gives smaller micro-batches: more of them, each within the budget."""
    import sara.train.learner as learner_module
    from sara.types import Decision, Group, Rollout

    policy = _llama(compute_dtype="float32")
    per_token = policy.activation_bytes_per_token()
    rollouts = tuple(Rollout(prompt_id=f"p{i}", pool_index=i, completion="", reward=float(i % 2), num_tokens=40,
                             token_ids=tuple(range(5, 45)), prompt_token_ids=tuple(range(1, 5 + i % 8)),
                             logprobs=(-1.0,) * 40) for i in range(48))
    groups = [Group(group_id=0, prompt=None, pool_index=0, rollouts=rollouts, decision=Decision.COMMIT)]
    plans = {}
    for positions in (2000, 300):
        monkeypatch.setattr(learner_module, "device_memory_bytes", lambda device, p=positions: 24 * per_token * p)
        learner = Learner(policy, make_algo("grpo"), OptimConfig(lr=1e-5))
        batch = learner.make_batch(groups)
        plans[positions] = learner._plan(batch)
        assert all(m.tokens <= positions for m in plans[positions])
    assert len(plans[300]) > len(plans[2000])


def test_print_config_names_the_budget_it_resolves(capsys, tiny_model_dir, tmp_path):
    from sara.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"policy: hf\npolicy_options: {{model: {tiny_model_dir}, compute_dtype: float32}}\n"
                      "backend: hf\ntask: 'sara/Arithmetic-v0:max_digits=1,pool_size=20,eval_size=5'\n")
    capsys.readouterr()
    rc = main(["train", "--config", str(config), "--print-config"])
    out = capsys.readouterr().out
    assert rc == 0 and "microbatch_tokens: auto" in out
    line = next(x for x in out.splitlines() if "learner micro-batches" in x)
    per_token = HFPolicyConfig(model=str(tiny_model_dir), compute_dtype="float32").activation_bytes_per_token()
    assert f"at most {microbatch_budget('auto', per_token, machine_memory_bytes())[0]:,} positions" in line
