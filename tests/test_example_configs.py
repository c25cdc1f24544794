"""The shipped example configs load into valid ``TrainConfig``s, and the real-LLM learning config sizes SARA's first
round to its engine's batch (docs/results.md: what that admission buys on SmolLM2)."""

from pathlib import Path

import pytest

from sara.allocators import make_allocator
from sara.train.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))


def test_there_are_example_configs():
    assert len(CONFIGS) >= 5


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_example_config_is_valid(path: Path):
    cfg = load_config(path)
    assert make_allocator(cfg.allocator, k=cfg.k).k == cfg.k


def test_learning_config_fills_the_engine_batch():
    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "configs" / "smollm2_learn.yaml")
    alloc = make_allocator(cfg.allocator, k=cfg.k)
    assert alloc.name == "sara"
    assert float(alloc.config.oversample) * cfg.groups_per_step == cfg.backend_options["max_batch_size"]


@pytest.mark.hf
def test_reasoning_config_trains_two_steps_on_a_small_model(tiny_model_dir, tmp_path):
    """``smollm2_reason.yaml`` as shipped (task, HF policy and backend, GRPO + sara), with a 2-layer stand-in for
    SmolLM2 and a small batch: two steps run, and the run accounts its tokens by fate and its seconds by phase."""
    pytest.importorskip("transformers")
    from sara.train import Trainer

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "configs" / "smollm2_reason.yaml")
    assert cfg.task.startswith("sara/Chain-v0") and cfg.max_new_tokens >= 64
    small = cfg.model_copy(update={
        "policy_options": {**cfg.policy_options, "model": str(tiny_model_dir)},
        "backend_options": {**cfg.backend_options, "max_batch_size": 16}, "k": 4, "groups_per_step": 2, "steps": 2,
        "max_new_tokens": 12, "max_rollouts_per_step": 64,
        "eval": cfg.eval.model_copy(update={"num_prompts": 4, "samples": 1}),
        "out_dir": str(tmp_path), "progress": False, "tensorboard": False, "threads": 1})
    with Trainer(small) as trainer:
        summary = trainer.train()
    assert summary.steps == 2 and summary.rollouts > 0
    assert sum(summary.tokens_by_fate[f] for f in ("committed", "abandoned", "discarded")) == summary.tokens
    assert summary.prompt_tokens > summary.tokens  # an 8-shot prompt is longer than 12 new tokens
    assert set(summary.seconds_by_phase) == {"collect", "advantages", "update", "sync"}
