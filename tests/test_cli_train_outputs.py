"""What ``sara train`` leaves behind: no checkpoint unless asked, every file it wrote listed in its summary, a run
directory that is never overwritten without ``--overwrite`` (``--resume`` continues it), TensorBoard events when the
``tensorboard`` extra is installed; ``Trainer.summary()`` counts wall time when stepping by hand; the progress bar
counts training steps (not the initial evaluation) and shows whole numbers as such."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("torch")

from sara.cli import main  # noqa: E402
from sara.metrics import MetricsLogger, read_jsonl  # noqa: E402
from sara.train.rundir import LOCK_NAME  # noqa: E402

SETTINGS = ["task=sara/Arithmetic-v0:max_digits=2,pool_size=400,eval_size=40",
            "policy_options={d_model: 32, n_layers: 1, n_heads: 2, warm_start: {steps: 30, batch_size: 32}}",
            "groups_per_step=4", "k=4", "steps=2", "eval.num_prompts=8", "eval.samples=1", "threads=1",
            "tensorboard=false"]


def _train(out: Path, *extra: str) -> int:
    argv = ["train", "--quiet", "--out", str(out)]
    for s in SETTINGS:
        argv += ["--set", s]
    return main(argv + list(extra))


def _files_row(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("| files written"))


def test_no_checkpoint_unless_asked_and_every_file_listed(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out) == 0
    assert not (out / "checkpoints").exists()  # checkpoint_every: 0 (the default) writes none
    row = _files_row(capsys.readouterr().out)
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != LOCK_NAME)
    assert written == ["learning_curve.png", "metrics.jsonl"]  # beside the run lock, which is not an output
    assert all(name in row for name in written)

    assert _train(out, "--overwrite", "--set", "checkpoint_every=1") == 0
    row = _files_row(capsys.readouterr().out)
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["ckpt-000001.pt", "ckpt-000001.pt.sha256", "ckpt-000002.pt", "ckpt-000002.pt.sha256"]
    assert all(f"checkpoints/{name}" in row for name in ckpts)


def test_a_run_directory_is_never_overwritten_silently(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "--set", "checkpoint_every=2") == 0
    first = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert _train(out) == 2
    err = capsys.readouterr().err
    assert f"{out} already holds a run" in err and "--overwrite" in err and "--resume" in err
    assert (out / "metrics.jsonl").read_text() == first  # untouched
    assert _train(out, "--resume", "--set", "steps=3") == 0  # --resume continues it
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3]
    (out / "checkpoints" / "stale.pt").write_text("x")
    assert _train(out, "--overwrite") == 0  # --overwrite replaces it: nothing of the old run survives
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
    assert not (out / "checkpoints").exists()


def test_bench_allocation_default_output_is_not_overwritten(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "allocation", "--k", "4", "--target-groups", "4", "--seeds", "1", "--pool-size", "200",
            "--allocators", "ds;sara", "--plot", str(tmp_path / "p.png")]
    assert main(argv) == 0
    assert "[bench allocation] sara (2/2), seed 1/1" in capsys.readouterr().err  # progress on stderr
    report = tmp_path / "runs" / "bench-allocation" / "allocation.json"
    before = report.read_text()
    assert main(argv) == 2 and "already holds a run" in capsys.readouterr().err
    assert report.read_text() == before
    assert main([*argv, "--overwrite"]) == 0


def test_tensorboard_events_when_installed(tmp_path, monkeypatch, capsys):
    class Writer:  # stands in for torch.utils.tensorboard.SummaryWriter (the tensorboard extra)
        def __init__(self, logdir):
            self.path = Path(logdir) / "events.out.tfevents.test"
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

        def add_scalar(self, key, value, step):
            with self.path.open("a") as fh:
                fh.write(f"{step} {key} {value}\n")

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Writer))
    out = tmp_path / "run"
    assert _train(out, "--set", "tensorboard=null") == 0  # null: use it when it imports
    events = (out / "tb" / "events.out.tfevents.test").read_text()
    assert "2 env/cum_rollouts" in events
    assert "tb/events.out.tfevents.test" in _files_row(capsys.readouterr().out)


def test_summary_counts_wall_time_when_stepping_by_hand(tmp_path):
    from sara.train import TrainConfig, Trainer, apply_overrides

    cfg = TrainConfig(**apply_overrides({}, SETTINGS), out_dir=str(tmp_path), progress=False)
    with Trainer(cfg) as trainer:
        m1, m2 = trainer.train_step(), trainer.train_step()
        s = trainer.summary()
    assert s.steps == 2 and s.rollouts > 0
    assert s.wall_seconds == pytest.approx(m1["time/step"] + m2["time/step"]) and s.wall_seconds > 0


def test_progress_bar_counts_training_steps_with_readable_numbers(tmp_path, capsys):
    pytest.importorskip("tqdm")
    logger = MetricsLogger(tmp_path, total_steps=3, progress=True, tensorboard=False,
                           show={"rollouts": "env/cum_rollouts"})
    logger.log(0, {"env/cum_rollouts": 0.0})  # the initial evaluation: not a step
    assert logger._bar.n == 0
    for step in (1, 2, 3):
        logger.log(step, {"env/cum_rollouts": 1456.0 * step})
    assert logger._bar.n == 3 and logger._bar.total == 3
    logger.close()
    err = capsys.readouterr().err
    shown = re.sub(r"[\d.?]+(it/s|s/it)", "RATE", err)  # tqdm's rate is timing: any digits (CI saw 15728.64it/s)
    assert "rollouts=4,368" in err and "e+03" not in shown
    assert "3/3" in shown and not re.search(r"\d+it\b", shown)  # counts steps, never rollouts as iterations
