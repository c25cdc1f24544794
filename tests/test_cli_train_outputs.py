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
    (folder,) = (tmp_path / "runs").iterdir()  # the allocators and the options that differ, in the name
    assert folder.name.startswith("bench-allocation-ds+sara-")
    report = folder / "allocation.json"
    before = report.read_text()
    assert main(argv) == 2 and "already holds a run" in capsys.readouterr().err
    assert report.read_text() == before
    assert main([*argv, "--overwrite"]) == 0
    argv[argv.index("ds;sara")] = "ds;sara_paper"  # another command, pasted next: another directory
    assert main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [folder.name, folder.name.replace("ds+sara-",
                                                                                                      "ds+sara_paper-")]


def test_default_run_names_carry_what_differs(tmp_path, monkeypatch, capsys):
    def name(*argv: str) -> str:
        import yaml

        assert main(["train", "--print-config", *argv]) == 0
        return yaml.safe_load(capsys.readouterr().out)["name"]

    monkeypatch.chdir(tmp_path)
    assert name() == "grpo-sara-arithmetic"  # the embedded run
    assert name("--set", "allocator=ds") == "grpo-ds-arithmetic"
    assert name("--set", "sampler=predictive") == "grpo-sara@predictive-arithmetic"
    assert name("--set", "algo=rloo", "--set", "seed=3") == "grpo-sara-arithmetic".replace("grpo", "rloo") + "-seed3"
    assert name("--set", "allocator=sara_paper:tau_low=0.45") == "grpo-sara_paper-tau_low=0.45-arithmetic"
    assert name("--driver", "stream") == "grpo-sara-arithmetic-stream"
    assert name("--quiet", "--set", "threads=1") == "grpo-sara-arithmetic"  # how, not what: the same run
    other = {name("--set", "steps=20"), name("--set", "steps=30"), name("--set", "task=sara/Arithmetic-v0"),
             name("--set", "task=sara/Arithmetic-v0:max_digits=3")}
    assert len(other) == 4 and all(n.startswith("grpo-sara-arithmetic-") for n in other)
    assert name("--set", "steps=20") == name("--set", "steps=20")  # the same command: the same run (--resume)
    assert name("--set", "name=mine") == "mine"  # a name given is kept ...
    assert name("--set", "name=mine", "--set", "allocator=ds", "--set", "sampler=predictive") == "mine-ds@predictive"
    config = Path("smollm2.yaml")
    config.write_text("name: smollm2-learn\nallocator: sara:oversample=8\n")
    assert name("--config", str(config)) == "smollm2-learn"
    assert name("--config", str(config), "--set", "allocator=sara") == "smollm2-learn-sara"
    assert name("--out", "runs/x") == "grpo-sara-arithmetic"  # --out is taken literally


def test_a_sampler_run_names_it_and_writes_its_summary_as_json(tmp_path, capsys):
    import json

    report = tmp_path / "summary.json"
    assert _train(tmp_path / "run", "--set", "sampler=predictive", "--json", str(report)) == 0
    out = capsys.readouterr().out
    assert "sara train: grpo + sara@predictive on sara/Arithmetic-v0" in out  # the header names the sampler
    assert "| grpo + sara@predictive |" in out
    data = json.loads(report.read_text())
    assert data["sampler"] == "predictive" and data["config"]["sampler"] == "predictive"
    assert data["rollouts_per_effective_group"] == pytest.approx(data["rollouts"] / data["effective_groups"])
    assert data["command_seconds"] >= data["wall_seconds"] > 0  # the whole command: setup and warm start too
    row = next(line for line in out.splitlines() if line.startswith("| rollouts per effective group"))
    assert f"{data['rollouts_per_effective_group']:.1f}" in row
    wall = next(line for line in out.splitlines() if line.startswith("| wall time"))
    assert "the whole command" in wall and f"JSON: {report}" in out


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


def test_the_bar_shows_rollouts_per_effective_group(tmp_path, capsys):
    from sara.metrics import ROLLOUTS_PER_EFFECTIVE_GROUP, metric_value

    assert metric_value({"env/cum_rollouts": 100.0, "env/cum_effective_groups": 8.0},
                        ROLLOUTS_PER_EFFECTIVE_GROUP) == 12.5
    assert metric_value({"env/cum_rollouts": 0.0, "env/cum_effective_groups": 0.0}, ROLLOUTS_PER_EFFECTIVE_GROUP) is None
    logger = MetricsLogger(tmp_path, total_steps=2, progress=True, tensorboard=False, print_every=1,
                           show={"rollouts/eff_group": ROLLOUTS_PER_EFFECTIVE_GROUP})
    logger._bar = None  # the plain-line fallback (no tqdm), which prints every step
    logger.log(1, {"env/cum_rollouts": 100.0, "env/cum_effective_groups": 8.0})
    logger.close()
    assert "step 1: rollouts/eff_group=12.5" in capsys.readouterr().err


def test_the_warm_start_reports_progress(monkeypatch, capsys):
    import sara.policies.tiny as tiny

    monkeypatch.setattr(tiny, "PROGRESS_EVERY_S", 0.0)
    on_step = tiny.WarmStartProgress(tiny.WarmStartConfig(steps=400, target_loss=0.25, loss_window=2))
    on_step(0, 1.0)
    on_step(1, 0.5)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[1].startswith("[warm start] step 2 of at most 400: mean loss 0.750 (target 0.25), ")
    assert err[1].endswith(" s more")


def test_model_prepare_says_what_it_does(monkeypatch, tmp_path, capsys):
    import sara.hub as hub

    monkeypatch.setattr(hub, "check_torch_companions", lambda: None)
    monkeypatch.setattr(hub, "prepare_model", lambda name, cache_dir, **kw: tmp_path / "model")
    assert main(["model", "prepare", "smollm2", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("preparing smollm2 into ") and "a few minutes" in out and "a line every 15 s" in out


def test_matrix_output_names_carry_what_differs():
    from sara.cli import build_parser
    from sara.commands.names import matrix_out

    def out(*argv: str) -> str:
        args, unknown = build_parser().parse_known_args(["matrix", *argv])
        assert not unknown
        return matrix_out(args)

    assert out() == "runs/matrix" and out("--quick") == "runs/matrix-quick"
    readme = out("--quick", "--algos", "grpo;rloo", "--allocators", "ds;sara;sara@predictive")
    assert readme == "runs/matrix-quick-grpo+rloo-ds+sara+sara@predictive"
    assert out("--quick", "--algos", "grpo", "--allocators", "ds;sara") == "runs/matrix-quick-grpo-ds+sara"
    assert out("--seeds", "5") == "runs/matrix-seeds5"
    hashed = {out("--steps", "60"), out("--set", "eval.every=5"), out("--set", "eval.every=4"),
              out("--config", "a.yaml")}
    assert len(hashed) == 4 and all(h.startswith("runs/matrix-") for h in hashed)
    assert out("--workers", "2") == "runs/matrix"  # how fast, not what: the same matrix (it resumes there)
    long = out("--allocators", ";".join(f"sara:tau_low=0.{i}" for i in range(1, 9)))
    assert len(long) < 100  # a long spec is cut and hashed
