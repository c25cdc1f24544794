"""Results outlive machines: ``sara matrix --store DIR`` keeps every finished cell x seed as small text files; a
copy of only those files, rerun elsewhere with more seeds, runs only the missing ones; a changed config or sara version
is refused (or, with ``--allow-mixed``, reported apart, never pooled); ``--report DIR`` prints the report from the files
alone, with the machines each cell's seeds ran on; and the per-cell measures of what the saving depends on."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from sara.bench.summary import t_interval
from sara.experiments.cells import Cell
from sara.experiments.matrix import PHASE_KEYS

pytestmark = pytest.mark.isa  # results depend on the CPU's kernels: .ci/run runs these under AVX2 too

TINY = ["task=sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8", "groups_per_step=2", "k=2",
        "eval.num_prompts=4", "eval.samples=1", "eval.greedy=false", "scorer=inline", "tensorboard=false",
        "policy_options={d_model: 16, n_layers: 1, n_heads: 2, warm_start: {steps: 0}}"]
"""The suite's fastest matrix: a one-layer tiny policy, no warm start, 2 groups of 2 per step."""


def _matrix(*extra: str, sets: tuple[str, ...] = ()) -> list[str]:
    return ["matrix", "--algos", "grpo", "--steps", "2", "--workers", "1", *extra,
            *[arg for s in (*TINY, *sets) for arg in ("--set", s)]]


@pytest.fixture
def counted(monkeypatch):
    """The runs the matrix trains, as ``(cell run name)``, in order."""
    import sara.experiments.matrix as matrix

    names: list[str] = []
    train = matrix._run_one

    def run_one(cfg, stopped=lambda: None):
        names.append(cfg["name"])
        return train(cfg, stopped)

    monkeypatch.setattr(matrix, "_run_one", run_one)
    return names


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_copied_store_reruns_only_the_missing_seeds_and_reports_machines_per_cell(tmp_path, run_cli, counted):
    pytest.importorskip("torch")
    here, there = tmp_path / "here", tmp_path / "there"
    store = here / "results" / "tiny"
    rc, err = run_cli(_matrix("--allocators", "ds;sara", "--store", str(store), "--out", str(here / "runs" / "m")))
    assert rc == 0, err
    assert counted == ["grpo-ds-seed0", "grpo-sara-seed0"]
    files = _files(store)
    assert sorted(files) == ["cells/grpo-ds/seed0.json", "cells/grpo-ds/seed0.metrics.jsonl",
                             "cells/grpo-sara/seed0.json", "cells/grpo-sara/seed0.metrics.jsonl", "store.json"]
    rec = json.loads(files["cells/grpo-ds/seed0.json"])
    assert files["cells/grpo-ds/seed0.json"].decode() == json.dumps(rec, sort_keys=True, indent=1) + "\n"
    assert rec["cell"]["spec"] == "ds" and rec["seed"] == 0 and len(rec["config_hash"]) == 12
    assert rec["sara_version"] and rec["machine"]["cpu"] and rec["machine_kind"]
    assert "out_dir" not in rec["config"] and "seed" not in rec["config"] and "out_dir" not in rec["result"]
    assert rec["result"]["curve"]["acc"] and "collect_s" in rec["result"]["phases"]
    assert len(files["cells/grpo-ds/seed0.metrics.jsonl"].splitlines()) >= 2

    # a fresh clone: the store's files only (no run directories), and one of its runs made on another machine
    shutil.copytree(store, there / "results" / "tiny")
    moved = there / "results" / "tiny" / "cells" / "grpo-sara" / "seed0.json"
    other = json.loads(moved.read_text())
    other["machine"] = {**other["machine"], "cpu": "AMD EPYC 9999 Fake", "bf16_native": False, "usable_cores": 8,
                        "isa_limits": {}}  # whatever ONEDNN_MAX_CPU_ISA this suite runs under
    moved.write_text(json.dumps(other, sort_keys=True, indent=1) + "\n")
    kept = _files(there / "results" / "tiny")
    counted.clear()
    argv = _matrix("--allocators", "ds;sara", "--seeds", "2", "--store", str(there / "results" / "tiny"),
                   "--out", str(there / "runs" / "m"))
    rc, err = run_cli(argv)
    assert rc == 0, err
    assert counted == ["grpo-ds-seed1", "grpo-sara-seed1"]  # only the missing cell-seeds ran
    now = _files(there / "results" / "tiny")
    assert {k: now[k] for k in kept} == kept and len(now) == len(kept) + 4  # stored files unchanged, 2 runs added
    counted.clear()
    assert run_cli(argv)[0] == 0 and counted == []  # everything stored: nothing runs, the same report

    # the report from the committed files alone: no run directories, no training
    shutil.rmtree(there / "runs")
    rc, err = run_cli(["matrix", "--report", str(there / "results" / "tiny"), "--json", str(tmp_path / "r.json")])
    assert rc == 0 and counted == [], err
    report = json.loads((tmp_path / "r.json").read_text())
    ds, sara = report["cells"]
    assert (ds["cell"], sara["cell"]) == ("ds", "sara") and ds["aggregate"]["n"] == sara["aggregate"]["n"] == 2
    assert report["seeds"] == [0, 1] and report["store"]["variants"][0]["runs"] == 4
    here_kind = rec["machine_kind"]
    assert ds["aggregate"]["machines"] == {here_kind: 2}
    assert sara["aggregate"]["machines"] == {"AMD EPYC 9999 Fake, no native bf16, 8 cores": 1, here_kind: 1}


def test_a_changed_config_or_version_is_refused_and_allow_mixed_reports_it_apart(tmp_path, run_cli, counted,
                                                                                   monkeypatch):
    pytest.importorskip("torch")
    import sara

    store = tmp_path / "results" / "s"
    base = ("--allocators", "ds", "--store", str(store))
    assert run_cli(_matrix(*base, "--out", str(tmp_path / "a")))[0] == 0
    before = _files(store)
    old = json.loads(before["cells/grpo-ds/seed0.json"])["config_hash"]
    counted.clear()
    rc, err = run_cli(_matrix(*base, "--seeds", "2", "--out", str(tmp_path / "b"), sets=("optim.lr=0.001",)))
    assert rc == 2 and len(err) == 1 and counted == [], err
    assert "holds grpo-ds seed 0 of another config or version (field 'optim.lr' was 0.0002, now 0.001)" in err[0]
    assert "never pooled: use a new --store DIR, or --allow-mixed" in err[0]
    version = sara.__version__
    monkeypatch.setattr(sara, "__version__", "9.9.9")
    rc, err = run_cli(_matrix(*base, "--seeds", "2", "--out", str(tmp_path / "c")))
    assert rc == 2 and len(err) == 1 and f"(sara {version}, this is sara 9.9.9)" in err[0], err
    monkeypatch.setattr(sara, "__version__", version)
    assert _files(store) == before and counted == []  # a refused rerun writes nothing, runs nothing

    # --allow-mixed: the stored seed stays, the missing one runs under the new config, and they are never pooled
    rc, err = run_cli(_matrix(*base, "--seeds", "2", "--allow-mixed", "--out", str(tmp_path / "d"),
                              "--json", str(tmp_path / "mixed.json"), sets=("optim.lr=0.001",)))
    assert rc == 0 and counted == ["grpo-ds-seed1"], err
    cells = json.loads((tmp_path / "mixed.json").read_text())["cells"]
    assert [c["cell"] for c in cells] == ["ds", f"ds [cfg {old[:6]}, sara {version}]"]
    assert [[r["seed"] for r in c["runs"]] for c in cells] == [[1], [0]]
    assert cells[0]["is_reference"] and not cells[1]["is_reference"]
    rc, err = run_cli(["matrix", "--report", str(store), "--json", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and len(report["store"]["variants"]) == 2 and [c["aggregate"]["n"] for c in report["cells"]] == [1, 1]


def test_store_refusals_are_one_line(tmp_path, run_cli):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine\n")
    rc, err = run_cli(["matrix", "--report", str(tmp_path / "busy")])
    assert rc == 2 and len(err) == 1 and "is not a results store (no store.json)" in err[0], err
    rc, err = run_cli(["matrix", "--allow-mixed"])
    assert rc == 2 and "--allow-mixed applies to a results store; add --store DIR" in err[0], err
    rc, err = run_cli(["matrix", "--store", str(tmp_path / "r"), "--out", str(tmp_path / "r" / "runs")])
    assert rc == 2 and "lies inside --store" in err[0], err


# ------------------------------------------------------------------------------ what the saving depends on
def _run(seed, acc, groups, *, rollouts=300, tokens=3000, collect=6.0, learn=2.0, kind="A"):
    n = len(acc)
    return {"seed": seed, "steps": 3, "acc_before": acc[0], "acc_after": acc[-1], "rollouts": rollouts,
            "tokens": tokens, "effective_groups": groups[-1], "committed_groups": groups[-1], "machine_kind": kind,
            "phases": {**dict.fromkeys(PHASE_KEYS, 1.0), "collect_s": collect, "learn_s": learn},
            "curve": {"step": list(range(n)), "rollouts": [0, 100, 200, 300][:n], "tokens": [0, 1000, 2000, 3000][:n],
                      "wall_s": [0, 1, 2, 3][:n], "acc": acc, "effective_groups": groups}}


def test_the_report_measures_what_the_saving_depends_on_per_cell():
    from sara.experiments.matrix_report import analyze, format_report

    ds, sara = Cell("grpo", "ds", None, "ds", "grpo-ds"), Cell("grpo", "sara", None, "sara", "grpo-sara")
    runs = [(ds, _run(0, [0.5, 0.55, 0.6, 0.6], [0, 3, 6, 10])),
            (ds, _run(1, [0.5, 0.6, 0.65, 0.7], [0, 3, 6, 10], collect=3.0, learn=3.0, kind="B")),
            (sara, _run(0, [0.5, 0.6, 0.7, 0.7], [0, 4, 8, 12], collect=9.0, learn=1.0)),
            (sara, _run(1, [0.5, 0.7, 0.7, 0.75], [0, 2, 4, 6], collect=4.0, learn=4.0))]
    report = analyze(runs, budget=300)
    target = report["algos"]["grpo"]["target"]
    assert target == pytest.approx(0.65)
    d, s = (c["aggregate"]["costs"] for c in report["cells"])
    # DS seed 0 never reaches 0.65 (its 10 groups, censored), seed 1 reaches it at 6; SARA's seed 0 halfway from 4
    # to 8 groups (0.6 -> 0.7), seed 1 three quarters of the way from 0 to 2 (0.5 -> 0.7)
    assert d["effective_groups_to_target"]["mean"] == pytest.approx(8.0)
    assert s["effective_groups_to_target"]["mean"] == pytest.approx((6.0 + 1.5) / 2)
    assert s["effective_groups_to_target_ratio"] == pytest.approx(3.75 / 8.0)
    assert s["rollouts_per_effective_group"]["mean"] == pytest.approx((300 / 12 + 300 / 6) / 2)
    assert s["rollouts_per_effective_group"]["half"] == pytest.approx(t_interval([25.0, 50.0])[1])
    assert d["tokens_per_effective_group"]["mean"] == pytest.approx(300.0)
    assert s["acc_gain_per_100_effective_groups"]["mean"] == pytest.approx((0.2 / 12 + 0.25 / 6) * 100 / 2)
    assert d["generation_share"]["mean"] == pytest.approx((0.75 + 0.5) / 2)
    assert s["generation_share"]["mean"] == pytest.approx((0.9 + 0.5) / 2)
    assert report["cells"][0]["aggregate"]["machines"] == {"A": 1, "B": 1}
    text = format_report(report)
    assert "What the saving depends on" in text and "| cell | seeds | machines (seeds) |" in text
    assert "| ds | ≥ 8.0 ± " in text and "| ds | 2 | A: 1; B: 1 |" in text and "| sara | 2 | A: 2 |" in text
    assert f"| 0.47 ± {s['effective_groups_to_target_ratio_half']:.2f} |" in text
    assert math.isfinite(s["generation_share"]["half"])


def test_a_micro_batch_budget_pools_and_runs_stored_before_a_field_turned_volatile_keep_pooling(tmp_path, run_cli,
                                                                                             counted):
    """The micro-batch budget splits the same loss into forwards (like threads): runs pool across it. A record stored
    while it was still in the hash (its config carries the field) is hashed under today's ``VOLATILE``."""
    pytest.importorskip("torch")
    from sara.experiments.store import config_hash, record_hash

    store = tmp_path / "results" / "s"
    base = ("--allocators", "ds", "--store", str(store))
    assert run_cli(_matrix(*base, "--out", str(tmp_path / "a")))[0] == 0
    path = store / "cells" / "grpo-ds" / "seed0.json"
    rec = json.loads(path.read_text())
    assert "microbatch_tokens" not in rec["config"]["optim"]
    rec["config"]["optim"]["microbatch_tokens"] = 2048  # as a run stored before the field was volatile
    rec["config_hash"] = config_hash(rec["config"])
    assert record_hash(rec) != rec["config_hash"]
    path.write_text(json.dumps(rec, sort_keys=True, indent=1) + "\n")
    counted.clear()
    rc, err = run_cli(_matrix(*base, "--seeds", "2", "--out", str(tmp_path / "b"), "--json", str(tmp_path / "m.json"),
                              sets=("optim.microbatch_tokens=512",)))
    assert rc == 0 and counted == ["grpo-ds-seed1"], err
    cells = json.loads((tmp_path / "m.json").read_text())["cells"]
    assert [c["cell"] for c in cells] == ["ds"] and [r["seed"] for r in cells[0]["runs"]] == [0, 1]
