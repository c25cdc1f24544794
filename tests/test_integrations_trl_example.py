"""examples/trl_async_grpo.py end to end: TRL's AsyncGRPOTrainer trains on SARA's variable-size groups (CPU).

The example's default is SmolLM2-135M (measured in docs/integrations.md); the suite runs the same script on a random
2-layer Llama with SmolLM2's tokenizer and a task a random model solves half the time, so it fits CI's 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import zlib
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]')")

from sara.envs.tasks import Task, register_task  # noqa: E402
from sara.types import Prompt  # noqa: E402

EXAMPLE = Path(__file__).parent.parent / "examples" / "trl_async_grpo.py"


def verify_parity(completion: str, *, salt: int) -> float:
    """1.0 for about half of all texts: a fixed hash bit of the completion."""
    return float(zlib.crc32(f"{salt}|{completion}".encode()) % 2 == 0)


def make_parity_task() -> Task:
    prompts = [Prompt(id=f"parity-{i:03d}", prompt=f"Item {i}:", answer={"salt": i}) for i in range(64)]
    return Task(id="tests/Parity-v0", prompts=prompts[8:], eval_prompts=prompts[:8], verifier=verify_parity,
                max_new_tokens=3)


@pytest.mark.slow
def test_example_trains_through_async_grpo_with_variable_size_groups(tiny_model_dir, tmp_path, capsys):
    register_task("tests/Parity-v0", make_parity_task, override=True)
    spec = importlib.util.spec_from_file_location("trl_async_grpo_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out_json = tmp_path / "out.json"
    example.main(["--steps", "2", "--model", str(tiny_model_dir), "--task", "tests/Parity-v0", "--batch-size", "16",
                  "--target-groups", "4", "--max-new-tokens", "3", "--lr", "1e-3", "--output-dir",
                  str(tmp_path / "run"), "--json", str(out_json),
                  "--eval-prompts", "8", "--eval-every", "1"])
    out = json.loads(out_json.read_text())
    steps = [rec for rec in out["log_history"] if "loss" in rec]
    assert [rec["step"] for rec in steps] == [1, 2]  # TRL's loss, logged per optimizer step
    # The worker publishes sara/ metrics once per collection, before that collection's samples: the first optimizer
    # step always has some; a later one has them only if a collection finished in its window (the worker runs ahead
    # asynchronously, so a step can train on groups collected earlier).
    assert "sara/rollouts_total" in steps[0]
    for rec in steps:
        assert 0.0 <= rec["reward"] <= 1.0
        if "sara/rollouts_total" not in rec:
            assert not any(key.startswith("sara/") for key in rec)
            continue
        assert rec["sara/rollouts_total"] > 0 and rec["sara/committed_groups_total"] > 0
        assert rec["sara/effective_fraction"] == 1.0  # SARA commits mixed groups only
        assert "sara/rollouts_saved_vs_ds" in rec and "sara/group_size_mean" in rec
    sizes = out["trained_group_sizes"]
    assert len(set(sizes)) > 1 and min(sizes) >= 2, f"groups of one size only reached the trainer: {sizes}"
    # cold sync + one sync per optimizer step, each loaded into the generating backend under the trainer's version
    assert out["trainer_version"] == out["backend_version"] == 3
    # held-out accuracy before training, after step 1 and at the end, each on the weights the trainer had synced
    evals = out["eval"]
    assert [e["step"] for e in evals] == [0, 1, 2]
    assert all(0.0 <= e["acc"] <= 1.0 for e in evals)
    assert [e["weights_version"] for e in evals][1:] == [2.0, 3.0]
    assert evals[0]["rollouts"] == 0 < evals[1]["rollouts"] <= evals[2]["rollouts"] <= out["rollouts"]
    printed = capsys.readouterr().out
    assert "step 2: loss=" in printed and "groups trained:" in printed and "held-out acc" in printed
