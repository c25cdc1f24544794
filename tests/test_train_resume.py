"""Checkpoint / resume: a run killed with SIGKILL and resumed from its last checkpoint logs the same metrics as an
uninterrupted run with the same seed (wall-clock keys aside)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from sara.metrics import deterministic_view, read_jsonl  # noqa: E402
from sara.train.checkpoint import latest_checkpoint  # noqa: E402

# A small, fast run: tiny model, short warm start (cached in a per-test cache dir), a few steps.
SETTINGS = [
    "task=sara/Arithmetic-v0:max_digits=2,pool_size=400,eval_size=40",
    "policy_options={d_model: 32, n_layers: 1, n_heads: 2, warm_start: {steps: 30, batch_size: 32}}",
    "groups_per_step=6", "k=4", "steps=8", "checkpoint_every=2", "keep_checkpoints=3",
    "eval.every=3", "eval.num_prompts=20", "eval.samples=2", "threads=1", "progress=false",
    "allocator=sara:tau_low=0.45", "algo=ppo", "optim.minibatch_rollouts=8", "optim.epochs=2",
    "optim.schedule=cosine", "optim.warmup_steps=2",
]


def _cmd(out: Path, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "sara.cli", "train", "--quiet", "--out", str(out)]
    for s in SETTINGS:
        args += ["--set", s]
    return args + list(extra)


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    env = {**os.environ, "SARA_CACHE_DIR": str(tmp_path / "cache")}
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cmd(full), check=True, env=env, capture_output=True, timeout=600)
    reference = read_jsonl(full / "metrics.jsonl")
    assert [r["step"] for r in reference] == list(range(9))

    proc = subprocess.Popen(_cmd(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # kill as soon as the first checkpoint (step 2) is on disk
            ckpt = latest_checkpoint(killed / "checkpoints")
            if ckpt is not None or proc.poll() is not None:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    last = latest_checkpoint(killed / "checkpoints")
    assert last is not None and int(last.stem.split("-")[1]) < 8
    assert len(read_jsonl(killed / "metrics.jsonl")) < len(reference)

    subprocess.run(_cmd(killed, "--resume"), check=True, env=env, capture_output=True, timeout=600)
    resumed = read_jsonl(killed / "metrics.jsonl")
    assert deterministic_view(resumed) == deterministic_view(reference)
    # the run exercised what a checkpoint must carry: PPO's value head, several optimizer steps per step, a schedule
    per_step = [2 * -(-int(r["alloc/committed_rollouts"]) // 8) for r in reference[1:]]  # epochs x mini-batches
    assert all("algo/vf_loss" in r for r in reference[1:]) and min(per_step) >= 4
    assert [r["algo/optimizer_steps"] for r in reference[1:]] == per_step
    assert reference[-1]["train/optimizer_steps"] == sum(per_step)
    assert reference[3]["train/lr"] != reference[-1]["train/lr"]
    assert [r["step"] for r in reference if "eval/acc_sample" in r] == [0, 3, 6, 8]
