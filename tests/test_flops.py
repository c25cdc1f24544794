"""A run's FLOP floor (``sara.train.flops``): the counts of a model, the floor of a generation call and an update, and
a run that adds them up by part and prints them beside its seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from sara.train.flops import FLOP_PARTS, FlopFloor, ModelFlops, floor_seconds
from sara.types import Rollout

PREAMBLE = tuple(range(100, 120))  # 20 tokens every prompt shares (>= shared_prefix's 8)


def rollout(prompt: tuple[int, ...] | None, tokens: int) -> Rollout:
    return Rollout(prompt_id="p", pool_index=0, completion="", reward=0.0, num_tokens=tokens, prompt_token_ids=prompt)


def test_span_and_decode_count_positions_and_causal_pairs():
    m = ModelFlops(position=3.0, head=5.0, pair=2.0)
    assert m.span(0, 1) == 3.0 + 1 * 2.0  # one position attending to itself
    assert m.span(2, 4) == 2 * 3.0 + (3 + 4) * 2.0  # positions 2 and 3 attend to 3 and 4 keys
    assert m.span(0, 4) == m.span(0, 2) + m.span(2, 4)
    assert m.decode(10, 3) == m.span(10, 13) + 3 * 5.0


def test_a_generation_call_prefills_the_preamble_once_and_each_distinct_prompt_once():
    m = ModelFlops(position=1.0, head=10.0, pair=0.0)
    floor = FlopFloor(m)
    a, b = PREAMBLE + (1, 2, 3), PREAMBLE + (4, 5)
    group_a = [rollout(a, 4), rollout(a, 6)]  # a group of two completions of one prompt
    # 20 shared + 3 + 2 prompt positions once; each generated token one position and its logits
    assert floor.generation([*group_a, rollout(b, 5)]) == (20 + 3 + 2) + (4 + 6 + 5) * (1.0 + 10.0)
    # the same rollouts one by one: every call prefills its whole prompt again
    one_by_one = sum(floor.generation([r]) for r in [*group_a, rollout(b, 5)])
    assert one_by_one == 2 * 23 + 22 + (4 + 6 + 5) * 11.0 > floor.generation([*group_a, rollout(b, 5)])
    assert floor.generation([rollout(None, 7)]) == 7 * 11.0  # no prompt ids: the tokens alone
    assert floor.generation([]) == 0.0


def test_attention_counts_each_token_against_its_context():
    m = ModelFlops(position=0.0, head=0.0, pair=1.0)
    prompt = PREAMBLE + (1,)  # 21 positions
    # the prompt: 21 * 22 / 2 pairs; token j (0-based) of the completion attends to 21 + j + 1 keys
    assert FlopFloor(m).generation([rollout(prompt, 3)]) == 21 * 22 / 2 + (22 + 23 + 24)


def test_an_update_is_a_forward_and_its_backward_per_epoch():
    m = ModelFlops(position=2.0, head=7.0, pair=0.5)
    floor = FlopFloor(m)
    groups = [[rollout(PREAMBLE + (1,), 4), rollout(PREAMBLE + (1,), 2)], [rollout(PREAMBLE + (2, 3), 5)]]
    forward = floor.generation(r for g in groups for r in g)
    assert floor.update(groups, epochs=1) == 3 * forward
    assert floor.update(groups, epochs=2) == 6 * forward


def test_an_unknown_policy_has_a_nan_floor():
    floor = FlopFloor.of_policy(object())
    assert floor.model is None
    assert math.isnan(floor.generation([rollout(PREAMBLE, 3)])) and math.isnan(floor.update([[rollout(None, 1)]], 1))
    with pytest.raises(TypeError, match="PreTrainedModel"):
        ModelFlops.of(object())


def test_floor_seconds_divides_each_part_by_its_rate():
    flops = {"collect": 4e12, "update": 6e12, "eval": 1e12}
    assert floor_seconds(flops, {"collect": 100.0, "update": 300.0, "eval": 100.0}) == pytest.approx(40 + 20 + 10)


@pytest.mark.hf
def test_model_flops_of_a_small_llama(tiny_model_dir):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    module = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    m = ModelFlops.of(module)
    # hidden 32, 4 heads of 8, 2 KV heads, MLP 64: q 32x32, k and v 32x16, o 32x32, gate / up 32x64, down 64x32
    per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64
    assert m.position == 2.0 * 2 * per_layer
    assert m.head == 2.0 * module.config.vocab_size * 32
    assert m.pair == 4.0 * 2 * 4 * 8


@pytest.mark.hf
def test_a_run_adds_its_floor_by_part_and_prints_it_beside_its_seconds(tiny_model_dir, tmp_path):
    """The reasoning config with a 2-layer stand-in (and the uniform allocator, so that the random model's saturated
    groups are trained): every part's floor is counted, it lies between what the tokens
    alone need and what prefilling every rollout's prompt apart would need, and the summary prints its seconds."""
    pytest.importorskip("transformers")
    from sara.commands.train import format_summary, summary_report
    from sara.train import Trainer
    from sara.train.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "configs" / "smollm2_reason.yaml")
    small = cfg.model_copy(update={
        "policy_options": {**cfg.policy_options, "model": str(tiny_model_dir)},
        "backend_options": {**cfg.backend_options, "max_batch_size": 16}, "k": 4, "groups_per_step": 2, "steps": 2,
        "max_new_tokens": 8, "max_rollouts_per_step": 32, "allocator": "uniform",  # trains every group it draws
        "eval": cfg.eval.model_copy(update={"num_prompts": 4, "samples": 1}),
        "out_dir": str(tmp_path), "progress": False, "tensorboard": False, "threads": 1, "checkpoint_every": 2})
    with Trainer(small) as trainer:
        summary = trainer.train()
        m = trainer.floor.model
    with Trainer(small, resume=True) as resumed:  # the floor's totals are checkpointed and pass resume's checks
        assert resumed.step == 2 and resumed.summary().flop_floor == summary.flop_floor
    assert m is not None and set(summary.flop_floor) == set(FLOP_PARTS)
    assert all(v > 0 for v in summary.flop_floor.values()) and summary.trained_tokens > 0
    tokens_alone = summary.tokens * (m.position + m.head)
    apart = summary.prompt_tokens * m.position + tokens_alone  # no attention, every prompt prefilled per rollout
    assert tokens_alone < summary.flop_floor["collect"]
    assert summary.flop_floor["collect"] < apart + (summary.prompt_tokens + summary.tokens) ** 2 * m.pair
    assert summary.flop_floor["update"] >= 3 * summary.trained_tokens * (m.position + m.head)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for part in FLOP_PARTS:
        series = [r.get(f"perf/cum_flop_floor_{part}", 0.0) for r in records]  # absent until a part is counted
        assert series == sorted(series) and series[-1] == pytest.approx(summary.flop_floor[part])
    assert sum(r.get("eval/flop_floor", 0.0) for r in records) == pytest.approx(summary.flop_floor["eval"])
    rates = {"collect": 50.0, "update": 25.0, "eval": 50.0}
    table = format_summary(summary, k=small.k, rates=rates)
    at = floor_seconds(summary.flop_floor, rates)
    assert "FLOP floor" in table and f"= {at:.0f} s at this CPU's matmul rate" in table
    assert f"the run took {summary.wall_seconds / at:.1f}x that" in table
    report = summary_report(summary, small, 1.0, rates)
    assert report["flop_floor_seconds"] == pytest.approx(at) and report["matmul_gflops"] == rates
    assert "FLOP floor" not in format_summary(summary.__class__(**{**summary.__dict__, "flop_floor": {}}), k=small.k)
