"""Run directories are transactions: every command that writes one (``sara train``, ``sara matrix``, ``sara bench
allocation``) takes its run lock before it touches anything, so ``--overwrite`` never deletes a live run's files;
``--resume`` with nothing to resume refuses and keeps the earlier run's files; ``sara matrix`` plans its runs in
``matrix-plan.json`` (a rerun must plan the same ones), marks each finished run with ``result.json``, and on SIGINT /
SIGTERM stops its workers within seconds (none survive it, even after SIGKILL), reports no unfinished run as a result
and is finished by a rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from sara.config import ConfigError  # noqa: E402
from sara.experiments.matrix_runs import (  # noqa: E402
    PLAN_NAME,
    RESULT_NAME,
    MatrixInterrupted,
    claim_plan,
    finished_result,
    run_all,
    save_result,
)
from sara.storage import on_write_point  # noqa: E402
from sara.train import TrainConfig, Trainer  # noqa: E402
from sara.train.rundir import NothingToResume, RunLock  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["task=sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8", "groups_per_step=2", "k=2",
        "eval.num_prompts=4", "eval.samples=1", "eval.greedy=false", "scorer=inline", "tensorboard=false",
        "policy_options={d_model: 16, n_layers: 1, n_heads: 2, warm_start: {steps: 0}}"]
MATRIX = ["matrix", "--algos", "grpo", "--allocators", "uniform", "--target-acc", "0.5"]


def _sets(settings: list[str]) -> list[str]:
    return [arg for s in settings for arg in ("--set", s)]



def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != ".sara.lock"}


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to a parent that does not reap it has stopped)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat")
        return not (stat.is_file() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")
    except (ProcessLookupError, FileNotFoundError):
        return False


# --------------------------------------------------------------------------------- the lock comes first
@pytest.mark.parametrize("command", ["train", "matrix", "bench"])
def test_overwrite_never_touches_a_directory_another_run_holds(command, tmp_path, run_cli):
    out = tmp_path / "live"
    files = {"train": ["metrics.jsonl", "checkpoints/ckpt-000002.pt", "tb/events", "learning_curve.png"],
             "matrix": ["matrix.json", PLAN_NAME, "cells/grpo-ds/seed0/metrics.jsonl"],
             "bench": ["allocation.json", "allocation.png"]}[command]
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(f"live {name}\n")
    before = _snapshot(out)
    argv = {"train": ["train", "--quiet", *_sets(TINY)], "matrix": [*MATRIX, *_sets(TINY)],
            "bench": ["bench", "allocation", "--k", "4", "--target-groups", "4", "--seeds", "1", "--pool-size",
                      "100"]}[command]
    with RunLock(out):  # a live run (the lock conflicts within one process as across processes)
        rc, err = run_cli([*argv, "--out", str(out), "--overwrite"])
    assert rc == 2 and len(err) == 1 and "is in use by another sara run (pid" in err[0], err
    assert _snapshot(out) == before  # nothing deleted, nothing written


# --------------------------------------------------------------------------------- --resume
def test_resume_of_a_directory_without_a_run_is_refused_and_creates_nothing(tmp_path, run_cli):
    rc, err = run_cli(["train", "--quiet", "--resume", "--out", str(tmp_path / "none"), *_sets(TINY)])
    assert rc == 2 and len(err) == 1 and "holds no run to continue" in err[0] and "drop --resume" in err[0], err
    assert not (tmp_path / "none").exists()


def test_resume_of_a_run_without_checkpoints_keeps_its_files(tmp_path, monkeypatch, run_cli):
    from sara.policies import POLICIES

    out = tmp_path / "finished"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (out / "learning_curve.png").write_bytes(b"png")
    before = _snapshot(out)
    monkeypatch.setattr(POLICIES, "factory", lambda *a, **k: pytest.fail("the policy was built"))
    rc, err = run_cli(["train", "--quiet", "--resume", "--out", str(out), "--set", "seed=7", *_sets(TINY)])
    assert rc == 2 and len(err) == 1, err
    assert "holds a run but it has no checkpoint" in err[0] and "its files are kept" in err[0], err
    assert _snapshot(out) == before


@pytest.mark.parametrize("checkpoints", ["none", "truncated"])
def test_trainer_resume_with_nothing_to_resume_refuses_and_keeps_the_run(checkpoints, tmp_path):
    cfg = TrainConfig(task="sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8", groups_per_step=2, k=2,
                      steps=1, checkpoint_every=int(checkpoints != "none"), scorer="inline", progress=False,
                      eval={"num_prompts": 4, "samples": 1, "greedy": False}, tensorboard=False, threads=1,
                      out_dir=str(tmp_path),
                      policy_options={"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}})
    with Trainer(cfg) as trainer:
        trainer.train()
    if checkpoints == "truncated":
        ckpt = tmp_path / "checkpoints" / "ckpt-000001.pt"
        ckpt.write_bytes(ckpt.read_bytes()[:100])
    before = _snapshot(tmp_path)
    error, match = ((NothingToResume, "holds a run but it has no checkpoint") if checkpoints == "none" else
                    (ConfigError, "no usable checkpoint in .*checksum mismatch"))
    with pytest.raises(error, match=match) as err:
        Trainer(cfg, resume=True)
    assert "\n" not in str(err.value) and _snapshot(tmp_path) == before
    with Trainer(cfg):  # the refusal kept no lock
        pass


def test_resume_and_overwrite_together_are_refused(tmp_path, run_cli):
    rc, err = run_cli(["train", "--resume", "--overwrite", "--out", str(tmp_path)])
    assert rc == 2 and "not both" in err[-1], err


# --------------------------------------------------------------------------------- the matrix's plan and markers
def _cfgs(tmp_path: Path, n: int, **extra) -> list[dict]:
    return [{"out_dir": str(tmp_path / "cells" / "c" / f"seed{i}"), "seed": i, **extra} for i in range(n)]


def test_a_rerun_must_plan_the_same_runs(tmp_path):
    cfgs = _cfgs(tmp_path, 2, lr=0.1)
    assert claim_plan(tmp_path, [("c", c["seed"], c) for c in cfgs]) == 0
    save_result(cfgs[0], {"seed": 0, "acc_after": 0.5})
    assert claim_plan(tmp_path, [("c", c["seed"], c) for c in cfgs]) == 1  # the same plan: one finished earlier
    changed = [{**c, "lr": 0.2} for c in cfgs]
    with pytest.raises(ConfigError, match=r"planned differently \(c seed 0: field 'lr' was 0.1, now 0.2\)"):
        claim_plan(tmp_path, [("c", c["seed"], c) for c in changed])
    with pytest.raises(ConfigError, match=r"planned differently \(other cells or seeds\).*--overwrite"):
        claim_plan(tmp_path, [("c", c["seed"], c) for c in _cfgs(tmp_path, 3, lr=0.1)])


def test_a_rerun_may_change_only_where_or_how_fast_its_runs_go(tmp_path):
    """Fields of ``store.VOLATILE`` (threads, the micro-batch budget) split the same runs differently: a rerun that
    changes them finishes the same matrix and keeps its finished runs; any other field is still refused."""
    cfgs = _cfgs(tmp_path, 2, lr=0.1, threads=1, optim={"lr": 0.1, "microbatch_tokens": 2048})
    assert claim_plan(tmp_path, [("c", c["seed"], c) for c in cfgs]) == 0
    save_result(cfgs[0], {"seed": 0, "acc_after": 0.5})
    moved = [{**c, "threads": 2, "optim": {"lr": 0.1, "microbatch_tokens": "auto"}} for c in cfgs]
    assert claim_plan(tmp_path, [("c", c["seed"], c) for c in moved]) == 1  # the finished run counts
    assert finished_result(moved[0]) == {"seed": 0, "acc_after": 0.5}
    assert finished_result({**moved[0], "seed": 5}) is None  # another seed's result is not this run's
    relearn = [{**c, "optim": {"lr": 0.2, "microbatch_tokens": "auto"}} for c in moved]
    with pytest.raises(ConfigError, match=r"field 'optim.lr' was 0.1, now 0.2"):
        claim_plan(tmp_path, [("c", c["seed"], c) for c in relearn])


def test_a_result_counts_only_for_its_own_config(tmp_path):
    (cfg,) = _cfgs(tmp_path, 1, lr=0.1)
    assert finished_result(cfg) is None
    save_result(cfg, {"seed": 0, "acc_after": float("nan")})
    assert finished_result(cfg)["seed"] == 0
    assert finished_result({**cfg, "lr": 0.2}) is None  # another config's result is not this run's
    (Path(cfg["out_dir"]) / RESULT_NAME).write_text('{"config": ')  # torn
    assert finished_result(cfg) is None


DEEP = "[" * 200_000 + "]" * 200_000  # valid JSON nested past the parser's recursion limit


def test_a_deeply_nested_result_or_plan_reads_as_damaged(tmp_path):
    (cfg,) = _cfgs(tmp_path, 1, lr=0.1)
    Path(cfg["out_dir"]).mkdir(parents=True)
    (Path(cfg["out_dir"]) / RESULT_NAME).write_text(DEEP)
    assert finished_result(cfg) is None  # unfinished, as a torn one
    (tmp_path / PLAN_NAME).write_text(DEEP)
    with pytest.raises(ConfigError, match=r"planned differently \(other cells or seeds\)") as err:
        claim_plan(tmp_path, [("c", cfg["seed"], cfg)])
    assert "\n" not in str(err.value)


def test_run_all_skips_finished_runs_and_reports_no_unfinished_one(tmp_path):
    cfgs = _cfgs(tmp_path, 4)
    save_result(cfgs[0], {"seed": 0})
    called, reported = [], []

    def work(cfg, stopped):
        called.append(cfg["seed"])
        return "SIGINT" if cfg["seed"] == 2 else save_result(cfg, {"seed": cfg["seed"]})

    with pytest.raises(MatrixInterrupted, match="stopped by SIGINT: 2 of 4 runs finished") as err:
        run_all(work, cfgs, workers=1, labels=[f"s{i}" for i in range(4)],
                on_result=lambda i, r: reported.append(r["seed"]))
    assert called == [1, 2] and reported == [0, 1] and err.value.unfinished == ["s2", "s3"]
    assert [finished_result(c) is not None for c in cfgs] == [True, True, False, False]


def test_an_interrupted_cell_is_never_reported_as_a_result(tmp_path, monkeypatch, run_cli):
    """The trainer's own stop (its summary says ``interrupted``) leaves the run unfinished: no ``result.json``, no
    ``matrix.json``, a ``matrix.md`` that names it; exit 128 + the signal."""
    real = Trainer.train

    def stopped_second(self, *a, **k):
        summary = real(self, *a, **k)
        if self.config.seed == 1:
            summary.interrupted = "SIGINT"
        return summary

    monkeypatch.setattr(Trainer, "train", stopped_second)
    out = tmp_path / "m"
    renamed = []  # the status page is written atomically
    with on_write_point(lambda point, path: renamed.append(path) if point == "atomic.rename" else None):
        rc, err = run_cli([*MATRIX, "--steps", "2", "--seeds", "2", "--workers", "1", "--out", str(out),
                           *_sets(TINY)])
    assert rc == 128 + signal.SIGINT and "stopped by SIGINT: 1 of 2 runs finished" in err[-1], err
    assert not (out / "matrix.json").exists() and "grpo-uniform seed 1" in (out / "matrix.md").read_text()
    assert out / "matrix.md" in renamed
    assert (out / "cells/grpo-uniform/seed0" / RESULT_NAME).is_file()
    assert not (out / "cells/grpo-uniform/seed1" / RESULT_NAME).exists()


# --------------------------------------------------------------------------------- signals and worker processes
WORKERS_SCRIPT = """
import os, sys, time
from pathlib import Path
from sara.experiments.matrix_runs import MatrixInterrupted, run_all, save_result
from sara.train.guards import StopSignals

LONG = [int(s) for s in sys.argv[3].split(",")]

def work(cfg, stopped):
    d = Path(cfg["out_dir"]); d.mkdir(parents=True, exist_ok=True)
    (d / "pid").write_text(str(os.getpid()))
    if cfg["seed"] not in LONG:
        return save_result(cfg, {"seed": cfg["seed"]})
    with StopSignals() as stop:  # what Trainer.train does: finish the step, write a checkpoint, return
        for _ in range(1200):
            if stop.received:
                time.sleep(1.0)
                (d / "stopped").write_text(stop.received)
                return stop.received
            time.sleep(0.05)
    return save_result(cfg, {"seed": cfg["seed"]})

if __name__ == "__main__":
    out, n = Path(sys.argv[1]), int(sys.argv[2])
    cfgs = [{"out_dir": str(out / f"s{i}"), "seed": i} for i in range(n)]
    try:
        run_all(work, cfgs, workers=2, labels=[f"s{i}" for i in range(n)], on_result=lambda i, r: None)
    except MatrixInterrupted as exc:
        print("interrupted", exc.signal_name, exc.finished, ",".join(exc.unfinished), flush=True)
        sys.exit(3)
"""


def _start_workers(tmp_path: Path, runs: int = 4, long: tuple[int, ...] = (1, 2)) -> tuple[subprocess.Popen, list[int]]:
    """4 runs on 2 workers: s0 returns at once, s1 and s2 run until stopped, s3 waits in the queue (or as given:
    ``runs`` runs, the ``long`` ones run until stopped); returns once every run but the queued one has started."""
    script = tmp_path / "matrix_workers.py"
    script.write_text(textwrap.dedent(WORKERS_SCRIPT))
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as err:  # not pipes: a surviving
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "out"), str(runs),  # worker would
                                 ",".join(map(str, long))], stdout=out, stderr=err, cwd=ROOT,  # hold them open
                                start_new_session=True)
    started = [tmp_path / "out" / f"s{i}" / "pid" for i in range(3)]
    deadline = time.monotonic() + 60
    while not all(p.is_file() and p.read_text() for p in started):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
        time.sleep(0.05)
    time.sleep(0.3)  # inside their StopSignals (or idle)
    return proc, sorted({int(p.read_text()) for p in started})


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the process group"])
def test_a_signal_stops_the_workers_within_seconds(how, tmp_path):
    proc, workers = _start_workers(tmp_path)
    t0 = time.monotonic()
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    else:  # Ctrl-C in a terminal: the workers have sessions of their own, so the parent relays one SIGTERM
        os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=30)
    stdout = (tmp_path / "stdout").read_text()
    assert proc.returncode == 3 and time.monotonic() - t0 < 10, (proc.returncode, (tmp_path / "stderr").read_text())
    assert stdout.split() == ["interrupted", "SIGTERM" if how == "SIGTERM" else "SIGINT", "1", "s1,s2,s3"], stdout
    for i in (1, 2):
        assert (tmp_path / "out" / f"s{i}" / "stopped").read_text() == "SIGTERM"  # stopped, not killed
    assert not any(_alive(pid) for pid in workers)
    assert not (tmp_path / "out" / "s3").exists()  # the queued run never started


def test_a_worker_between_runs_does_not_take_the_others_down(tmp_path):
    """s0 and s2 return at once, so one worker is idle when SIGTERM comes while s1 trains: the idle worker must not
    die of it (the pool would then kill s1's worker before its checkpoint is written)."""
    proc, workers = _start_workers(tmp_path, runs=3, long=(1,))
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == 3 and (tmp_path / "stdout").read_text().split() == ["interrupted", "SIGTERM", "2", "s1"]
    assert (tmp_path / "out" / "s1" / "stopped").read_text() == "SIGTERM"
    assert not any(_alive(pid) for pid in workers)


def test_no_worker_survives_its_parent_even_after_sigkill(tmp_path):
    proc, workers = _start_workers(tmp_path)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in workers if _alive(pid)]
    for pid in survivors:  # (only when the guard is broken)
        os.kill(pid, signal.SIGKILL)
    assert not survivors
    assert all((tmp_path / "out" / f"s{i}" / "stopped").read_text() == "SIGTERM" for i in (1, 2))


@pytest.mark.slow
def test_sara_matrix_stopped_by_sigterm_reports_nothing_and_a_rerun_finishes_it(tmp_path, run_cli):
    """End to end: 3 runs on 2 workers; SIGTERM once the third (queued) run is training. Meanwhile a second matrix
    on the same --out is refused. The rerun keeps the finished runs' results and continues the others from their
    checkpoints."""
    out = tmp_path / "m"
    argv = [*MATRIX, "--steps", "150", "--seeds", "3", "--workers", "2", "--out", str(out), *_sets(TINY)]
    env = {**os.environ, "SARA_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "sara.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    cells = out / "cells" / "grpo-uniform"
    deadline = time.monotonic() + 120
    last = cells / "seed2" / "metrics.jsonl"  # the queued run: it starts once another one has finished
    while not (last.is_file() and len(last.read_text().splitlines()) > 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    rc, err = run_cli(argv)
    assert rc == 2 and "is in use by another sara run" in err[-1], err
    workers = {int((d / ".sara.lock").read_text()) for d in cells.iterdir() if (d / ".sara.lock").is_file()}
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and time.monotonic() - t0 < 20, stderr
    assert "stopped by SIGTERM" in stderr and not any(_alive(pid) for pid in workers - {proc.pid})
    assert not (out / "matrix.json").exists() and "Unfinished" in (out / "matrix.md").read_text()
    done = {d.name: (d / RESULT_NAME).read_bytes() for d in cells.iterdir() if (d / RESULT_NAME).is_file()}
    assert 1 <= len(done) < 3
    kept = {d.name: (max(int(p.stem.split("-")[1]) for p in (d / "checkpoints").glob("ckpt-*.pt")),
                     (d / "metrics.jsonl").read_text().splitlines())
            for d in cells.iterdir() if d.name not in done and list(d.glob("checkpoints/ckpt-*.pt"))}

    rc, err = run_cli(argv)
    assert rc == 0, err
    assert {name: (cells / name / RESULT_NAME).read_bytes() for name in done} == done  # kept as they were
    assert "seed2" in kept, (sorted(p.relative_to(cells).as_posix() for p in cells.rglob("*")), stderr[-3000:])
    for name, (step, lines) in kept.items():  # continued from its checkpoint: the records up to it are the same
        now = (cells / name / "metrics.jsonl").read_text().splitlines()
        assert now[:step + 1] == [r for r in lines if json.loads(r)["step"] <= step]
    report = json.loads((out / "matrix.json").read_text())
    assert [r["seed"] for r in report["cells"][0]["runs"]] == [0, 1, 2]
