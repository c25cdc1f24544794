"""Checkpoint / resume: a run killed with SIGKILL, or stopped with SIGINT / SIGTERM, and resumed from its last
checkpoint logs the same metrics as an uninterrupted run with the same seed (wall-clock keys aside); so does a run
resumed past a truncated, an empty and a maliciously pickled newest checkpoint (the malicious one never runs)."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from sara.metrics import deterministic_view, read_jsonl  # noqa: E402
from sara.train.checkpoint import checkpoint_path, latest_checkpoint, marker_path  # noqa: E402

# A small, fast run: tiny model, short warm start (cached in a per-test cache dir), a few steps.
SETTINGS = [
    "task=sara/Arithmetic-v0:max_digits=2,pool_size=400,eval_size=40",
    "policy_options={d_model: 32, n_layers: 1, n_heads: 2, warm_start: {steps: 30, batch_size: 32}}",
    "groups_per_step=6", "k=4", "steps=8", "checkpoint_every=2", "keep_checkpoints=4",
    "eval.every=3", "eval.num_prompts=20", "eval.samples=2", "threads=1", "progress=false",
    "allocator=sara_paper:tau_low=0.45", "algo=ppo", "optim.minibatch_rollouts=8", "optim.epochs=2",
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

    _kill_at_first_checkpoint(_cmd(killed), env, killed)
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


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """An uninterrupted run: its output directory (checkpoints 2, 4, 6, 8) and its records; and the env."""
    root = tmp_path_factory.mktemp("resume")
    env = {**os.environ, "SARA_CACHE_DIR": str(root / "cache")}
    subprocess.run(_cmd(root / "full"), check=True, env=env, capture_output=True, timeout=600)
    return root / "full", read_jsonl(root / "full" / "metrics.jsonl"), env


class _Touch:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


@pytest.mark.slow
def test_resume_skips_truncated_empty_and_malicious_checkpoints(reference_run, tmp_path):
    full, reference, env = reference_run
    run = tmp_path / "run"
    shutil.copytree(full, run, ignore=shutil.ignore_patterns("tb"))
    ckpts = run / "checkpoints"
    newest = checkpoint_path(ckpts, 8)  # a pickle whose payload creates a file, with a forged checksum marker
    pwned = tmp_path / "pwned"
    newest.write_bytes(pickle.dumps({"state": _Touch(str(pwned))}))
    marker_path(newest).write_text(f"{hashlib.sha256(newest.read_bytes()).hexdigest()}  {newest.name}\n")
    six = checkpoint_path(ckpts, 6)
    six.write_bytes(six.read_bytes()[:1000])  # truncated (as a full disk or an interrupted copy leaves it)
    checkpoint_path(ckpts, 4).write_bytes(b"")  # empty
    res = subprocess.run(_cmd(run, "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert not pwned.exists(), "resuming ran code from the checkpoint"
    warnings = [line for line in res.stderr.splitlines() if line.startswith("sara: warning:")]
    assert len(warnings) == 3, res.stderr
    assert "ckpt-000008.pt: refused by the weights-only loader" in warnings[0]
    assert "ckpt-000006.pt: checksum mismatch" in warnings[1] and "ckpt-000004.pt: empty file" in warnings[2]
    assert "resumed from" in res.stdout and "ckpt-000002.pt (step 2)" in res.stdout
    assert "Traceback" not in res.stderr
    assert deterministic_view(read_jsonl(run / "metrics.jsonl")) == deterministic_view(reference)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_writes_a_final_checkpoint_and_resume_matches(reference_run, tmp_path, sig):
    _, reference, env = reference_run
    out = tmp_path / "run"
    proc = subprocess.Popen(_cmd(out), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and latest_checkpoint(out / "checkpoints") is None and proc.poll() is None:
            time.sleep(0.02)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, (proc.returncode, stderr)
    assert "Traceback" not in stderr
    logged = read_jsonl(out / "metrics.jsonl")
    stopped_at = logged[-1]["step"]
    assert 2 <= stopped_at < 8, "the run finished before the signal arrived"
    final = latest_checkpoint(out / "checkpoints")
    assert final == checkpoint_path(out / "checkpoints", stopped_at)  # the step in flight finished, then saved
    assert f"stopped by {sig.name} after step {stopped_at}; checkpoint {final} written" in stderr
    res = subprocess.run(_cmd(out, "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert f"(step {stopped_at})" in res.stdout
    assert deterministic_view(read_jsonl(out / "metrics.jsonl")) == deterministic_view(reference)


@pytest.mark.slow
@pytest.mark.parametrize("carry_lag", [0, 1])
def test_streaming_run_killed_then_resumed_matches_uninterrupted(tmp_path, carry_lag):
    # The streaming driver aborts what is in flight at a checkpoint step's end (carry_lag: other steps hand it on),
    # so a checkpoint between steps holds all of its state: kill + resume logs the uninterrupted run's metrics
    # (aborted and carried rollouts and occupancy included).
    env = {**os.environ, "SARA_CACHE_DIR": str(tmp_path / "cache")}
    extra = ["--driver", "stream", "--set", "backend=tiny:max_batch_size=16", "--set", "allocator=sara:probe=2",
             "--set", "driver.fill_idle=true", "--set", "steps=5", "--set", "algo=grpo", "--set", "eval.every=2",
             "--set", f"driver.carry_lag={carry_lag}"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    subprocess.run(_cmd(full, *extra), check=True, env=env, capture_output=True, timeout=600)
    reference = read_jsonl(full / "metrics.jsonl")
    assert [r["step"] for r in reference] == list(range(6))
    assert sum(r["alloc/aborted_rollouts"] for r in reference[1:]) > 0 and reference[1]["alloc/mean_inflight"] > 0
    assert (sum(r["alloc/carried_in_rollouts"] for r in reference[1:]) > 0) == bool(carry_lag)
    _kill_at_first_checkpoint(_cmd(killed, *extra), env, killed)
    assert len(read_jsonl(killed / "metrics.jsonl")) < len(reference)
    subprocess.run(_cmd(killed, *extra, "--resume"), check=True, env=env, capture_output=True, timeout=600)
    assert deterministic_view(read_jsonl(killed / "metrics.jsonl")) == deterministic_view(reference)


def _kill_at_first_checkpoint(cmd: list[str], env: dict[str, str], out: Path) -> None:
    """Start a training run and SIGKILL it as soon as its first checkpoint is on disk (fails if it finished first)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and latest_checkpoint(out / "checkpoints") is None and proc.poll() is None:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
