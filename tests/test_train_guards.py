"""Failures that show: verifier errors / timeouts in the step metrics and the summary, a broken verifier stops the run
naming itself and an example, a checkpoint write that fails (disk full) keeps the previous one and says so, a task
without held-out prompts trains without evaluation."""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from sara.envs.tasks import TASKS, make_task, register_task  # noqa: E402
from sara.train import TrainConfig, Trainer  # noqa: E402
from sara.train.guards import VerifierFailure  # noqa: E402

TINY = {"task": "sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8", "groups_per_step": 2, "k": 2,
        "steps": 2, "eval": {"num_prompts": 4, "samples": 1, "greedy": False}, "threads": 1, "progress": False,
        "tensorboard": False, "scorer": "inline", "allocator": "uniform",
        "policy_options": {"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}}}


def _flaky_task(fail_every: int, *, eval_size: int = 8):
    """Arithmetic whose verifier raises on every ``fail_every``-th call (1: always)."""
    base = make_task(f"sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size={eval_size}")
    calls = [0]

    def verify(completion: str, **answer):
        calls[0] += 1
        if calls[0] % fail_every == 0:
            raise ZeroDivisionError(f"broken on call {calls[0]}")
        return base.verifier(completion, **answer)

    return dataclasses.replace(base, id="test/Flaky-v0", verifier=verify)


@pytest.fixture
def flaky():
    def register(fail_every: int, **kw):
        register_task("test/Flaky-v0", lambda **_: _flaky_task(fail_every, **kw), override=True)
        return "test/Flaky-v0"

    yield register
    TASKS._items.pop("test/Flaky-v0", None)


def test_verifier_errors_are_logged_per_step_and_summarized(flaky, tmp_path):
    cfg = TrainConfig(**{**TINY, "task": flaky(3), "out_dir": str(tmp_path), "max_verifier_failure_share": 0.9})
    with Trainer(cfg) as trainer:
        summary = trainer.train()
    from sara.metrics import read_jsonl

    steps = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    errors = [r["env/verifier_errors"] for r in steps]
    assert all(e > 0 for e in errors) and all(r["env/verifier_timeouts"] == 0 for r in steps)
    assert all(e <= r["alloc/rollouts"] for e, r in zip(errors, steps))
    assert steps[-1]["env/cum_verifier_errors"] == sum(errors) == summary.verifier_errors
    from sara.commands.train import format_summary

    assert f"| {summary.verifier_errors:,} / 0 |" in format_summary(summary, k=2).replace("  ", " ")


@pytest.mark.parametrize("allocator", ["uniform", "sara"])
def test_a_verifier_that_always_raises_stops_the_first_step(flaky, tmp_path, allocator):
    cfg = TrainConfig(**{**TINY, "task": flaky(1), "out_dir": str(tmp_path), "allocator": allocator})
    with Trainer(cfg) as trainer, pytest.raises(VerifierFailure) as err:
        trainer.train()
    msg = str(err.value)
    assert msg.startswith("verifier test_train_guards._flaky_task.<locals>.verify failed on ")
    failed = re.search(r"failed on (\d+) of \1 rollouts this step", msg)
    # SARA abandons all-0 groups and would keep drawing prompts until max_rounds: the check stops it mid-step
    assert failed and int(failed.group(1)) < 64 and "ZeroDivisionError: broken on call" in msg
    assert "max_verifier_failure_share=0.5" in msg and "e.g. on completion" in msg
    assert trainer.step == 0 and trainer.learner.optimizer_steps == 0  # no update on zeros


def test_cli_prints_the_verifier_failure_as_one_line(tmp_path):
    (tmp_path / "brokentask.py").write_text(textwrap.dedent("""
        import dataclasses
        from sara.envs.tasks import Task, make_task

        def verify(completion, **answer):
            raise RuntimeError("verifier backend unreachable")

        def make(**options) -> Task:  # the return annotation makes it a task entry point
            base = make_task("sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8")
            return dataclasses.replace(base, id="test/Broken-v0", verifier=verify)
    """))
    args = [sys.executable, "-m", "sara.cli", "train", "--quiet", "--out", str(tmp_path / "run"),
            "--set", "task=brokentask:make", "--set", "groups_per_step=2", "--set", "k=2", "--set", "steps=3",
            "--set", "policy_options={d_model: 16, n_layers: 1, n_heads: 2, warm_start: {steps: 0}}",
            "--set", "eval.num_prompts=2", "--set", "eval.samples=1", "--set", "threads=1", "--set", "scorer=thread"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert "Traceback" not in res.stderr and lines[-1].startswith("sara: error: verifier brokentask.verify failed")
    assert "RuntimeError: verifier backend unreachable" in lines[-1]


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    from sara.train import checkpoint as ck

    cfg = TrainConfig(**{**TINY, "out_dir": str(tmp_path), "steps": 3, "checkpoint_every": 1, "keep_checkpoints": 1})
    with Trainer(cfg) as trainer:
        trainer.train(steps=1)
        first = ck.latest_checkpoint(tmp_path / "checkpoints")
        saved = {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()}

        def disk_full(*a, **k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(ck, "atomic_write", disk_full)
        summary = trainer.train(steps=3)  # two more steps, both checkpoint writes fail; training goes on
    assert summary.steps == 3 and summary.checkpoint == str(first)
    err = capsys.readouterr().err
    assert f"could not write checkpoint {tmp_path / 'checkpoints' / 'ckpt-000002.pt'} (No space left on device); " \
           f"the previous checkpoint {first} is intact" in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "checkpoints").iterdir()} == saved
    monkeypatch.undo()
    assert ck.resume_checkpoint(tmp_path / "checkpoints")[1]["counters"]["step"] == 1


def test_a_task_without_held_out_prompts_trains_without_evaluation(flaky, tmp_path):
    cfg = TrainConfig(**{**TINY, "task": flaky(10**9, eval_size=0), "out_dir": str(tmp_path), "steps": 1})
    with Trainer(cfg) as trainer:
        summary = trainer.train()
    assert summary.steps == 1 and summary.rollouts > 0
    assert summary.acc_before != summary.acc_before  # nan: nothing was evaluated


def test_the_summary_and_every_step_report_the_peak_resident_memory(flaky, tmp_path):
    import json

    from sara.memory import peak_rss_mb

    cfg = TrainConfig(**{**TINY, "task": flaky(10**9, eval_size=0), "out_dir": str(tmp_path), "steps": 2})
    with Trainer(cfg) as trainer:
        summary = trainer.train()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["sys/peak_rss_mb"] for r in records if "sys/peak_rss_mb" in r]
    assert len(peaks) == 2 and 10 < peaks[0] <= peaks[1] <= summary.peak_rss_mb <= peak_rss_mb()
    for phase in ("collect", "update", "step"):  # each step's phases, within the run's peak
        assert all(10 < r[f"sys/peak_rss_mb/{phase}"] <= r["sys/peak_rss_mb"] for r in records if r.get("step"))


def test_a_run_reports_its_own_peak_not_the_processs(flaky, tmp_path):
    """Runs one after another in one process (``sara matrix``'s cells): each summary's peak is its own phases', not a
    higher mark the process reached before it."""
    import math
    import mmap

    from sara.memory import peak_rss_mb, rss_mb

    if math.isnan(rss_mb()):
        pytest.skip("this platform reports no resident size")
    with mmap.mmap(-1, 512 << 20) as block:  # the process's peak now holds 512 MiB more than the run will
        for at in range(0, 512 << 20, 1 << 20):
            block[at:at + (1 << 20)] = b"\x01" * (1 << 20)
    cfg = TrainConfig(**{**TINY, "task": flaky(10**9), "out_dir": str(tmp_path), "steps": 1})
    with Trainer(cfg) as trainer:
        summary = trainer.train()
    assert 10 < summary.peak_rss_mb < peak_rss_mb() - 256
