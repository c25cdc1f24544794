"""The CPU tree attention gives TRL's packed rows exactly the per-sample log-probs of a plain forward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]')")
packing = pytest.importorskip("trl.experimental.async_grpo.packing")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from sara.integrations.trl_attention import TREE_ATTENTION, tree_attention_mask, use_cpu_tree_attention  # noqa: E402


def sample(prompt, completion, group):
    ids = prompt + completion
    return {"input_ids": torch.tensor(ids), "completion_mask": torch.tensor([0] * len(prompt) + [1] * len(completion)),
            "old_log_probs": torch.zeros(len(ids)), "advantage": 1.0, "group_id": group}


SAMPLES = [sample([5, 6, 7, 8], [9, 10, 11], 0), sample([5, 6, 7, 8], [9, 12], 0),
           sample([5, 6, 7, 8], [13, 14, 15, 16], 0), sample([5, 6, 7, 8], [9, 10, 11], 0),
           sample([20, 21], [22, 23, 24], 1), sample([5, 6, 30], [31], 2)]


def test_mask_is_causal_over_each_segments_path():
    row = packing.TreeRow()
    for s in SAMPLES[:3]:
        row.add(s)
    p = row.pack()
    n = len(p["input_ids"])
    mask = tree_attention_mask(n, p["tree_kv_index"], p["tree_cu_seqlens_q"], p["tree_cu_seqlens_k"])
    assert mask.diagonal().all() and not mask.triu(1).any()
    # a token sees exactly its own sample's prefix: as many keys as its depth in the trie + 1
    assert torch.equal(mask.sum(1), p["position_ids"] + 1)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_forward_matches_per_sample_forward(kv_heads):
    use_cpu_tree_attention()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    row = packing.TreeRow()
    for s in SAMPLES:
        row.add(s)
    p = row.pack()
    assert len(p["input_ids"]) < sum(len(s["input_ids"]) for s in SAMPLES)  # shared prompts forwarded once
    model.set_attn_implementation(TREE_ATTENTION)
    with torch.no_grad():
        logits = model(input_ids=p["input_ids"][None], position_ids=p["position_ids"][None],
                       tree_kv_index=p["tree_kv_index"], tree_cu_seqlens_q=p["tree_cu_seqlens_q"],
                       tree_cu_seqlens_k=p["tree_cu_seqlens_k"], tree_max_seqlen_q=int(p["tree_max_seqlens"][0]),
                       tree_max_seqlen_k=int(p["tree_max_seqlens"][1])).logits[0]
    packed = torch.log_softmax(logits.float(), -1)[p["token_index"], p["shift_labels"][p["token_index"]]]
    model.set_attn_implementation("eager")
    expected = []
    with torch.no_grad():
        for s in SAMPLES:
            ids = s["input_ids"]
            lp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
            expected += [lp[t - 1, ids[t]] for t in range(1, len(ids)) if s["completion_mask"][t]]
    assert len(expected) == len(packed)
    torch.testing.assert_close(packed, torch.stack(expected), atol=1e-5, rtol=1e-5)
