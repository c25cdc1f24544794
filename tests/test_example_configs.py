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
