"""Every count the command line takes is bounded before anything runs (``sara.commands.counts``), and
``python -m sara.integrations.verl_task`` answers bad input as ``sara`` does: one line, ``sara: error: ...``, exit
status 2, nothing written.

Where the bound were missing, each command would start its work; every test adds a second bad flag that the command
refuses right after the counts, so without the bound it fails at once on that one (or, where it would allocate, under
an address-space limit), never by running for hours."""

from __future__ import annotations

import pytest
from test_hardening_bounds import _one_line  # the one-line error check (memory_cap: conftest.py)

from sara.integrations.verl_task import main as verl_task_main


# ------------------------------------------------------------------------------------------ sara matrix
@pytest.mark.parametrize(("flag", "value", "bound"), [("--seeds", "5000", "[1, 1,000]"),
                                                       ("--steps", "10000000", "[1, 1,000,000]"),
                                                       ("--workers", "100000", "[1, 1,024]")])
def test_matrix_counts_are_bounded(tmp_path, run_cli, flag, value, bound):
    rc, err = run_cli(["matrix", "--quick", flag, value, "--target-acc", "2", "--out", str(tmp_path / "m")])
    _one_line(rc, err, f"field '{flag[2:]}'", bound, f"(got {value})")
    assert not (tmp_path / "m").exists()


def test_matrix_cells_times_seeds_is_bounded(tmp_path, run_cli):
    # 4 algorithms x 3 allocators x 1000 seeds: each count within its bound, 12,000 runs past 10,000. The invalid
    # --reference is refused right after: without the bound the test fails on it instead of starting the runs.
    rc, err = run_cli(["matrix", "--algos", "grpo;rloo;ppo;reinforce_pp", "--allocators", "uniform;ds;sara",
                       "--seeds", "1000", "--reference", "a;b", "--out", str(tmp_path / "m")])
    _one_line(rc, err, "12 cells x 1000 seeds = 12,000 runs", "10,000", "--seeds")
    assert not (tmp_path / "m").exists()


# ------------------------------------------------------------------------------------------ sara bench
def test_bench_decisions_units_are_bounded_before_they_are_allocated(tmp_path, run_cli, memory_cap):
    rc, err = run_cli(["bench", "decisions", "--units", "1000000000", "--json", str(tmp_path / "d.json")])
    _one_line(rc, err, "bench decisions", "field 'units'", "10,000,000")


@pytest.mark.parametrize(("argv", "needles"), [
    (["bench", "soak", "--steps", "1000000000", "--fault-rate", "2"], ("bench soak", "field 'steps'")),
    (["bench", "soak", "--seed", "-1", "--fault-rate", "2"], ("bench soak", "field 'seed'")),
    (["bench", "ray", "stream", "--workers", "5000", "--slots", "0"], ("bench ray stream", "field 'workers'")),
    (["bench", "ray", "scaling", "--workers", "1,5000", "--steps", "0"], ("bench ray scaling", "field 'workers'")),
    (["bench", "allocation", "--seeds", "1000000", "--pool-size", "0"], ("bench allocation", "seeds")),
    (["bench", "generation", "--seeds", "1000000", "--groups", "0"], ("bench generation", "seeds")),
    (["bench", "stream", "--rows", "10000000", "--prompts", "0"], ("bench stream", "rows")),
])
def test_bench_counts_are_bounded(tmp_path, run_cli, argv, needles):
    rc, err = run_cli([*argv, "--json", str(tmp_path / "r.json")])
    _one_line(rc, err, *needles)
    assert not (tmp_path / "r.json").exists()


# ------------------------------------------------------------------------------------------ sara train --set
@pytest.mark.parametrize(("key", "value", "bound"), [
    ("steps", "2000000", "1000000"), ("checkpoint_every", "2000000", "1000000"),
    ("keep_checkpoints", "100000", "1000"), ("rollout_budget", "10000000000000", "1000000000000"),
    ("max_rollouts_per_step", "10000000000000", "1000000000000"), ("optim.epochs", "5000", "1000"),
    ("optim.warmup_steps", "10000000000", "1000000000"), ("optim.total_optimizer_steps", "10000000000", "1000000000"),
    ("optim.minibatch_rollouts", "1000000", "131072"), ("optim.microbatch_tokens", "10000000000", "1073741824"),
    ("eval.every", "2000000", "1000000"), ("driver.carry_lag", "2000000", "1000000"),
    ("driver.lookahead", "100000", "65536"), ("driver.max_rounds", "2000000", "1000000"),
    ("driver.max_step_rollouts", "10000000000000", "1000000000000"), ("ray.max_restarts", "100000", "1000"),
    ("ray.micro_batch", "1000000", "65536"),
])
def test_train_config_counts_are_bounded(tmp_path, run_cli, key, value, bound):
    # --print-config: without the bound the command prints the config and exits 0 instead of training for days
    rc, err = run_cli(["train", "--set", f"{key}={value}", "--out", str(tmp_path / "r"), "--print-config"])
    _one_line(rc, err, f"field '{key}'", f"less than or equal to {bound}", f"(got {value})")
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------------------ verl_task
def _verl_task(capsys, argv: list[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    try:
        rc = verl_task_main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize(("argv", "needles"), [
    (["no_such_module:make_task"], ("unknown task 'no_such_module:make_task'",)),
    (["sara/Arithmetic-v0:pool_size=20,eval_size=5", "--limit", "-1"], ("field 'limit'", "(got -1)")),
    (["sara/Arithmetic-v0:pool_size=20,eval_size=5", "--limit", "0"], ("field 'limit'", "(got 0)")),
    (["sara/Arithmetic-v0:pool_size=0"], ("pool_size",)),
])
def test_verl_task_bad_input_is_one_line(tmp_path, capsys, argv, needles):
    out = tmp_path / "data"
    rc, err = _verl_task(capsys, [*argv, "--out", str(out)])
    _one_line(rc, err, *needles)
    assert not out.exists()


def test_verl_task_out_that_cannot_be_written_is_one_line(tmp_path, capsys):
    taken = tmp_path / "a_file"
    taken.write_text("not a directory")
    rc, err = _verl_task(capsys, ["sara/Arithmetic-v0:pool_size=20,eval_size=5", "--out", str(taken / "data")])
    _one_line(rc, err, f"--out '{taken / 'data'}' cannot be written")
    assert taken.read_text() == "not a directory"


def test_verl_task_limit_is_the_rows_written(tmp_path, capsys):
    import pandas as pd

    rc, _ = _verl_task(capsys, ["sara/Arithmetic-v0:pool_size=20,eval_size=5", "--limit", "3", "--out",
                                str(tmp_path / "d")])
    assert rc == 0 and len(pd.read_parquet(tmp_path / "d" / "train.parquet")) == 3
    assert len(pd.read_parquet(tmp_path / "d" / "test.parquet")) == 3
