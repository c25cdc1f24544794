"""Nothing is lost when the machine fails: a run killed at any named write point (``sara.storage.WRITE_POINTS``) and
resumed ends exactly as the uninterrupted run (its metrics log and its weights), a torn last log line included; a
resume killed while it cuts the log back is resumed again just as exactly; ``--overwrite`` killed at any point of its
retirement leaves the old run whole or gone, never half of it beside a new one; a full disk mid-run and a ``--json``
path that cannot be written are one-line errors naming the file (the latter before the run starts); symbolic links
planted in a run directory are refused with their targets untouched; a damaged or hostile metrics log on
``--resume`` is one line that keeps every file, and garbage after what the checkpoint vouches for is dropped."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from sara.metrics import deterministic_view, read_jsonl  # noqa: E402
from sara.storage import WRITE_POINTS, on_write_point  # noqa: E402
from sara.train import TrainConfig, Trainer  # noqa: E402
from sara.train.checkpoint import list_checkpoints, marker_path  # noqa: E402
from sara.train.rundir import RETIRED, NothingToResume  # noqa: E402

TINY = {"task": "sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8", "groups_per_step": 2, "k": 2,
        "steps": 3, "eval": {"num_prompts": 4, "samples": 1, "greedy": False}, "threads": 1, "progress": False,
        "tensorboard": False, "scorer": "inline", "allocator": "sara", "checkpoint_every": 1, "keep_checkpoints": 1,
        "policy_options": {"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}}}
SETS = [f"{k}={v}" for k, v in (("task", TINY["task"]), ("groups_per_step", 2), ("k", 2), ("steps", 3),
                                 ("eval.num_prompts", 4), ("eval.samples", 1), ("eval.greedy", "false"),
                                 ("scorer", "inline"), ("tensorboard", "false"), ("checkpoint_every", 1),
                                 ("keep_checkpoints", 1),
                                 ("policy_options", "{d_model: 16, n_layers: 1, n_heads: 2, warm_start: {steps: 0}}"))]
TORN = b'{"step": 9, "env/reward_mean": 0.'  # what a write killed halfway leaves


class Killed(BaseException):
    """The process dies at this write point (raised by a hook; nothing after it runs)."""


def _sets(*extra: str) -> list[str]:
    return [a for s in (*SETS, *extra) for a in ("--set", s)]


def _train(out: Path, *, resume: bool = False, hook=None) -> dict[str, torch.Tensor]:
    """One in-process run of TINY in ``out`` (with ``hook`` at every write point); the final weights."""
    with on_write_point(hook or (lambda name, path: None)):
        with Trainer(TrainConfig(**{**TINY, "out_dir": str(out)}), resume=resume) as trainer:
            trainer.train()
            return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def _kill_at(index: int, prefix: str = ""):
    """A hook that raises ``Killed`` at the ``index``-th write point (counting only those whose name starts with
    ``prefix``); ``.hit`` is the point and path it did it at (None: not reached)."""
    seen = []

    def hook(point: str, path: Path) -> None:
        if point.startswith(prefix):
            seen.append(point)
            if len(seen) == index + 1:
                hook.hit = (point, path)
                raise Killed(point)

    hook.hit = None
    return hook


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its deterministic records, weights and the write points it passed, in order."""
    out = tmp_path_factory.mktemp("crash") / "full"
    points: list[str] = []
    weights = _train(out, hook=lambda name, path: points.append(name))
    return deterministic_view(read_jsonl(out / "metrics.jsonl")), weights, points


def _recover(out: Path) -> dict[str, torch.Tensor]:
    """What a user does after a crash: ``--resume``; a run killed before its first checkpoint is started over."""
    try:
        return _train(out, resume=True)
    except NothingToResume:
        return _train(out)


def _assert_exact(out: Path, weights: dict[str, torch.Tensor], reference, where: str) -> None:
    records, ref_weights, _ = reference
    assert deterministic_view(read_jsonl(out / "metrics.jsonl")) == records, where
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights), where
    ckpts = list_checkpoints(out / "checkpoints")
    assert [p.name for p in ckpts] == ["ckpt-000003.pt"] and marker_path(ckpts[0]).is_file(), where


def test_a_kill_at_every_write_point_then_resume_is_exact(reference, tmp_path):
    _, _, points = reference
    assert points[8] == points[14] == "log.append" and points[9] == "atomic.temp"  # test_a_kill_while_resume...
    assert set(points) == set(WRITE_POINTS) - {"log.cut", "retire.staged", "retire.move", "retire.delete"}
    for i, point in enumerate(points):
        out = tmp_path / f"kill{i}"
        kill = _kill_at(i)
        with pytest.raises(Killed):
            _train(out, hook=kill)
        assert kill.hit[0] == point
        if point == "log.append":  # the record was being written: half of it reached the disk
            with open(out / "metrics.jsonl", "ab") as fh:
                fh.write(TORN)
        _assert_exact(out, _recover(out), reference, f"killed at write point {i} ({point} {kill.hit[1].name})")


@pytest.mark.parametrize("point", [8, 9, 14])  # write points after checkpoint 1 and after checkpoint 2 was complete
def test_a_kill_while_resume_cuts_the_log_then_resume_is_exact(reference, tmp_path, point):
    out = tmp_path / "run"
    with pytest.raises(Killed):
        _train(out, hook=_kill_at(point))
    with open(out / "metrics.jsonl", "ab") as fh:
        fh.write(b"\n" + TORN)  # more than the checkpoint vouches for: the resume must cut it
    cut = _kill_at(0, "log.cut")
    with pytest.raises(Killed):
        _train(out, resume=True, hook=cut)
    assert cut.hit is not None
    _assert_exact(out, _recover(out), reference, f"resume killed while cutting the log (first kill at {point})")


# ------------------------------------------------------------------------------------------------ --overwrite
@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """A finished run (checkpoint 3, metrics, plot) to be overwritten, and the write points of overwriting it."""
    from sara.cli import main

    template = tmp_path_factory.mktemp("overwrite") / "old"
    assert main(["train", "--quiet", "--out", str(template), *_sets()]) == 0
    trial = template.with_name("trial")
    shutil.copytree(template, trial)
    points: list[str] = []
    with on_write_point(lambda name, path: points.append(name)):
        assert main(["train", "--quiet", "--out", str(trial), "--overwrite", *_sets("steps=1")]) == 0
    return template, [p for p in points if p.startswith("retire.")]


def test_overwrite_killed_anywhere_leaves_the_old_run_whole_or_gone(old_run, tmp_path, run_cli):
    template, points = old_run
    assert points[0] == "retire.staged" and points[-1] == "retire.delete" and "retire.move" in points
    for i, point in enumerate(points):
        out = tmp_path / f"kill{i}"
        shutil.copytree(template, out)
        with pytest.raises(Killed), on_write_point(_kill_at(i, "retire.")):
            run_cli(["train", "--quiet", "--out", str(out), "--overwrite", *_sets("steps=1")])
        rc, err = run_cli(["train", "--quiet", "--out", str(out), "--resume", *_sets()])
        if point == "retire.staged":  # before the atomic step: the old run stands, finished, and resumes as itself
            assert rc == 0 and (out / "checkpoints" / "ckpt-000003.pt").is_file(), (i, point, err)
        else:  # after it: the next command finished the retirement; nothing of the old run is left to resume
            assert rc == 2 and len(err) == 1 and "holds no run to continue" in err[0], (i, point, err)
            assert not any((out / name).exists() for name in ("metrics.jsonl", "checkpoints", "learning_curve.png")), \
                (i, point, sorted(p.name for p in out.rglob("*")))
        assert not (out / RETIRED).exists() and not list(out.glob(".sara.retiring.*")), (i, point)


def test_overwrite_killed_while_deleting_never_lets_an_old_checkpoint_into_a_new_run(tmp_path, monkeypatch,
                                                                                  run_cli):
    """Without a hook: the deletion dies after its first step (as SIGKILL would), a new run then starts there, and
    its --resume must continue the new run, not the old run's later checkpoint."""
    out = tmp_path / "run"
    assert run_cli(["train", "--quiet", "--out", str(out), *_sets()])[0] == 0  # old run: checkpoint 3
    real_rmtree = shutil.rmtree

    def dies(path, *args, **kwargs):
        raise Killed(str(path))

    monkeypatch.setattr(shutil, "rmtree", dies)
    with pytest.raises(Killed):
        run_cli(["train", "--quiet", "--out", str(out), "--overwrite", *_sets("steps=1")])
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    rc, err = run_cli(["train", "--quiet", "--out", str(out), *_sets("steps=1")])  # a new run, 1 step
    assert rc in (0, 2), err
    if rc == 2:  # the directory still reads as the old run: the new one must replace it explicitly
        assert "already holds a run" in err[0]
        assert run_cli(["train", "--quiet", "--out", str(out), "--overwrite", *_sets("steps=1")])[0] == 0
    rc, err = run_cli(["train", "--quiet", "--out", str(out), "--resume", *_sets("steps=2")])
    assert rc == 0, err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2]
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["ckpt-000002.pt"]


# ------------------------------------------------------------------------------------------- full disk, --json
def test_a_full_disk_mid_run_is_one_line_naming_the_log_and_the_checkpoint_kept(reference, tmp_path, run_cli):
    out = tmp_path / "run"
    appends = []

    def full(point: str, path: Path) -> None:
        if point == "log.append":
            appends.append(path)
            if len(appends) == 3:  # step 2's record, after checkpoint 1; os.write's error names no file
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with on_write_point(full):
        rc, err = run_cli(["train", "--quiet", "--out", str(out), *_sets()])
    assert rc == 2 and len(err) == 1, err
    assert str(out / "metrics.jsonl") in err[0] and "No space left on device" in err[0]
    assert str(out / "checkpoints" / "ckpt-000001.pt") in err[0] and "--resume" in err[0]
    assert run_cli(["train", "--quiet", "--out", str(out), "--resume", *_sets()])[0] == 0
    assert deterministic_view(read_jsonl(out / "metrics.jsonl")) == reference[0]


@pytest.mark.parametrize("where", ["/proc/sara-nowhere/summary.json", "/dev/null/summary.json", "DIR"])
def test_an_unwritable_json_path_is_one_line_before_the_run_starts(where, tmp_path, run_cli):
    path = str(tmp_path) if where == "DIR" else where
    out = tmp_path / "run"
    rc, err = run_cli(["train", "--quiet", "--out", str(out), "--json", path, *_sets()])
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"sara: error: --json {path!r} cannot be written"), err
    assert not out.exists()  # nothing trained, nothing written


def test_a_full_disk_at_the_json_report_names_it_and_the_run_kept(tmp_path, run_cli):
    out, report = tmp_path / "run", tmp_path / "summary.json"

    def full(point: str, path: Path) -> None:
        if path == report and point == "atomic.temp":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with on_write_point(full):
        rc, err = run_cli(["train", "--quiet", "--out", str(out), "--json", str(report), *_sets("steps=1")])
    assert rc == 2 and len(err) == 1, err
    assert f"could not write the JSON report {report} (No space left on device)" in err[0]
    assert f"the run is complete in {out} (checkpoint {out / 'checkpoints' / 'ckpt-000001.pt'})" in err[0]
    assert not report.exists() and not list(tmp_path.glob(".summary.json.*"))


# ----------------------------------------------------------------------------------------------------- links
@pytest.mark.parametrize(("name", "kind"), [(".sara.lock", "file"), ("metrics.jsonl", "dangling"),
                                            ("learning_curve.png", "file"), ("checkpoints", "dir"),
                                            ("checkpoints/ckpt-000001.pt", "file"), ("tb", "dir")])
def test_links_planted_in_a_fresh_out_are_refused_and_never_followed(name, kind, tmp_path, run_cli):
    out, victim = tmp_path / "run", tmp_path / "victim"
    (out / name).parent.mkdir(parents=True)
    if kind == "dir":
        victim.mkdir()
        (victim / "keep.txt").write_text("mine\n")
    elif kind == "file":
        victim.write_text("mine\n")
    (out / name).symlink_to(victim)
    before = sorted((p.name, p.read_bytes()) for p in victim.rglob("*")) if victim.is_dir() else \
        (victim.read_bytes() if victim.exists() else None)
    rc, err = run_cli(["train", "--quiet", "--out", str(out), *_sets("steps=1")])
    assert rc == 2 and len(err) == 1, err
    assert str(out / name) in err[0] and "symbolic link" in err[0], err
    after = sorted((p.name, p.read_bytes()) for p in victim.rglob("*")) if victim.is_dir() else \
        (victim.read_bytes() if victim.exists() else None)
    assert after == before


# -------------------------------------------------------------------------------------- damaged files on resume
@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, reference):
    """The TINY run killed after checkpoint 2 (as step 3's record was to be appended): what --resume continues."""
    out = tmp_path_factory.mktemp("damaged") / "run"
    assert reference[2][14] == "log.append"
    with pytest.raises(Killed):
        _train(out, hook=_kill_at(14))
    return out


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != ".sara.lock"}


DAMAGE = {
    "a byte that is not UTF-8": lambda lines: [lines[0].replace(b'"step"', b'"st\xffp"'), *lines[1:]],
    "JSON nested too deeply": lambda lines: [b"[" * 200_000, *lines[1:]],
    "an integer too long to convert": lambda lines: [b'{"step": ' + b"1" * 5000 + b"}", *lines[1:]],
    "a record that is not an object": lambda lines: [b"[0, 1]", *lines[1:]],
    "a step that is not a number": lambda lines: [lines[0].replace(b'"step": 0', b'"step": "zero"'), *lines[1:]],
    "records lost": lambda lines: lines[:1],
    "records added": lambda lines: [lines[0], lines[0], *lines[1:]],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_metrics_log_on_resume_is_one_line_and_keeps_every_file(damage, two_steps, tmp_path, run_cli):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    log = out / "metrics.jsonl"
    log.write_bytes(b"\n".join(DAMAGE[damage](log.read_bytes().splitlines())) + b"\n")
    before = _snapshot(out)
    rc, err = run_cli(["train", "--quiet", "--out", str(out), "--resume", *_sets()])
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("sara: error: --resume: ") and str(log) in err[0]
    assert str(out / "checkpoints" / "ckpt-000002.pt") in err[0] and "--overwrite" in err[0]
    assert _snapshot(out) == before


def test_what_follows_the_checkpointed_log_is_dropped_and_resume_is_exact(reference, two_steps, tmp_path, run_cli):
    out = tmp_path / "run"
    shutil.copytree(two_steps, out)
    with open(out / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 3, "hostile": ' + b"[" * 100_000 + b"\n\xff\xfe garbage " + TORN)
    rc, err = run_cli(["train", "--quiet", "--out", str(out), "--resume", *_sets()])
    assert rc == 0, err
    assert deterministic_view(read_jsonl(out / "metrics.jsonl")) == reference[0]


@pytest.mark.slow
def test_sigkill_at_named_write_points_then_resume_is_exact(reference, tmp_path):
    """Real SIGKILLs (stray temp files and all): during checkpoint 3's write (the log already holds step 3), then
    during the resume's cut of the log; the second resume ends as the uninterrupted run."""
    out = tmp_path / "run"
    script = textwrap.dedent("""
        import os, signal, sys
        from sara.cli import main
        from sara.storage import on_write_point
        name, path_end, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
        def hook(point, path):
            if point == name and str(path).endswith(path_end):
                os.kill(os.getpid(), signal.SIGKILL)
        with on_write_point(hook):
            sys.exit(main(argv))
    """)
    env = {**os.environ, "SARA_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["train", "--quiet", "--out", str(out), *_sets()]
    for point, end, extra in [("atomic.temp", "ckpt-000003.pt", []), ("log.cut", "metrics.jsonl", ["--resume"])]:
        proc = subprocess.run([sys.executable, "-c", script, point, end, *argv, *extra], env=env,
                              capture_output=True, timeout=600)
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        if point == "atomic.temp":
            assert list((out / "checkpoints").glob(".ckpt-000003.pt.*.tmp"))  # the killed write's temp file
    proc = subprocess.run([sys.executable, "-m", "sara.cli", *argv, "--resume"], env=env, capture_output=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert deterministic_view(read_jsonl(out / "metrics.jsonl")) == reference[0]
    assert not list(out.rglob("*.tmp"))  # the resumed run's lock cleared them
