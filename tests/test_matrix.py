"""``sara matrix``: the cell spec language, the statistics (sara.experiments.curves, sara.bench.summary.t_interval),
the report on synthetic runs, and end-to-end runs (seeds x cells trained from the same policy at the same budget)."""

from __future__ import annotations

import json
import math
import re

import pytest

from sara.bench.summary import t_interval
from sara.config import ConfigError
from sara.experiments.cells import Cell, parse_cells, parse_specs
from sara.experiments.curves import (
    aggregate_measures,
    eval_standard_errors,
    first_reach,
    normalized_auc,
    seed_measures,
    value_at,
)

ALGOS = ["grpo", "rloo", "ppo", "reinforce_pp"]
ALLOCATORS = ["uniform", "ds", "sara"]
EVAL_SE = 0.02
"""About one held-out evaluation's standard error in the quick matrix (300 prompts x 2 samples at p ~ 0.55)."""
LOOSE_MARGIN = 0.005
"""Learning margin of held-out sampled accuracy (same eval seeds): a continuous / tree cell must end this much above
its start, and in the quick matrix each algorithm's mean gain over its allocators must exceed twice it. The warm start
lands at different losses on different CPUs, so the gains move with the machine: measured +0.055 to +0.086 per cell
on one (start 0.632), +0.005 to +0.074 on another (start 0.528; per-algorithm means +0.037 to +0.064)."""


# ------------------------------------------------------------------------------------------------ spec language
def test_cells_are_semicolon_separated_allocator_at_sampler_specs():
    cells = parse_cells("grpo;ppo:lam=0.95", "ds;sara;sara:prior=history,decay=0.95@predictive")
    assert [(c.algo, c.allocator, c.sampler) for c in cells[:3]] == [
        ("grpo", "ds", None), ("grpo", "sara", None), ("grpo", "sara:prior=history,decay=0.95", "predictive")]
    assert [c.algo for c in cells] == ["grpo"] * 3 + ["ppo:lam=0.95"] * 3
    assert cells[2].spec == "sara:prior=history,decay=0.95@predictive"
    names = [c.name for c in cells]
    assert len(set(names)) == 6 and all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    # the old comma form where it cannot be misread; one spec whose options are comma-separated
    assert [c.allocator for c in parse_cells("grpo,rloo", "uniform,ds,sara")][:3] == ["uniform", "ds", "sara"]
    assert parse_specs("sara:prior=history,decay=0.95", "allocators", example="x") == ["sara:prior=history,decay=0.95"]
    # names stay unique when two specs map to the same safe name
    a, b = parse_cells(["grpo"], ["sara:x=1", "sara@x=1"])
    assert a.name != b.name


@pytest.mark.parametrize("algos, allocators, field", [
    ("grpo", "ds,sara:prior=history", "allocators"),  # comma between specs, one of them with options
    ("grpo", "sara:prior=history,ds", "allocators"),
    ("grpo,ppo:lam=0.95", "ds", "algos"),
    ("grpo", "ds;ds", "allocators"),  # given twice
    ("grpo", "sara@", "allocators"),  # no sampler after @
    ("grpo@predictive", "ds", "algos"),
    ("grpo", " ; ", "allocators"),
])
def test_malformed_cell_lists_are_config_errors_naming_the_field(algos, allocators, field):
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        parse_cells(algos, allocators)


def test_the_command_shows_the_semicolon_form_on_an_ambiguous_list(capsys):
    from sara.cli import main

    assert main(["matrix", "--allocators", "ds,sara:prior=history"]) == 2
    err = capsys.readouterr().err
    assert "allocators" in err and "ds;sara:prior=history,decay=0.95@predictive" in err
    assert main(["matrix", "--seeds", "0"]) == 2
    assert "seeds" in capsys.readouterr().err
    assert main(["matrix", "--set", "task=sara/Arithmetic-v0:eval_size=0", "--out", "/nonexistent/m"]) == 2
    assert "field 'task'" in capsys.readouterr().err  # no held-out prompts: nothing to measure


# --------------------------------------------------------------------------------------------------- statistics
def test_rollouts_to_target_interpolate_between_evaluations_and_censor_when_never_reached():
    curve = {"rollouts": [0, 100, 200, 300], "tokens": [0, 1000, 3000, 4000], "wall_s": [0, 1, 2, 4],
             "acc": [0.5, 0.55, 0.65, 0.6]}
    m = seed_measures(curve, target=0.6, budget=300)
    assert m["reached"] and m["rollouts_to_target"] == pytest.approx(150)  # halfway from 0.55 to 0.65
    assert m["tokens_to_target"] == pytest.approx(2000) and m["wall_s_to_target"] == pytest.approx(1.5)
    never = seed_measures(curve, target=0.7, budget=300)
    assert not never["reached"]
    assert (never["rollouts_to_target"], never["tokens_to_target"], never["wall_s_to_target"]) == (300, 4000, 4)
    assert seed_measures(curve, target=0.4, budget=300)["rollouts_to_target"] == 0  # reached before training
    assert first_reach([0, 10, 20, 30], [0.5, 0.7, 0.5, 0.8], 0.6) == pytest.approx(5)  # the FIRST crossing
    assert first_reach([0, 10], [0.5, 0.6], 0.6) == 10  # ending exactly at the target reaches it
    agg = aggregate_measures([m, never])
    assert agg["reached"] == 1 and agg["n"] == 2
    assert agg["rollouts_to_target"]["mean"] == pytest.approx((150 + 300) / 2)  # censored at the run's total


def test_t_interval_against_a_hand_computed_example():
    mean, half = t_interval([1.0, 2.0, 3.0, 4.0])
    # sd = sqrt(5/3) = 1.29099, se = sd / 2 = 0.645497, t(0.975, df=3) = 3.182446
    assert mean == 2.5 and half == pytest.approx(3.182446 * 0.645497, rel=1e-5)
    assert half == pytest.approx(2.05426, rel=1e-4)
    one = t_interval([0.7])
    assert one[0] == 0.7 and math.isnan(one[1])
    assert t_interval([2.0, math.nan, 4.0])[0] == 3.0


def test_auc_and_accuracy_at_budget_fractions_on_a_hand_made_curve():
    xs, ys = [0, 50, 100], [0.2, 0.6, 0.6]
    assert normalized_auc(xs, ys, 100) == pytest.approx((0.4 * 50 + 0.6 * 50) / 100)
    assert normalized_auc(xs, ys, 200) == pytest.approx((0.4 * 50 + 0.6 * 50 + 0.6 * 100) / 200)  # flat after end
    assert normalized_auc(xs, ys, 50) == pytest.approx(0.4)
    assert value_at(xs, ys, 25) == pytest.approx(0.4) and value_at(xs, ys, 150) == 0.6
    m = seed_measures({"rollouts": xs, "tokens": xs, "wall_s": xs, "acc": ys}, target=0.6, budget=100)
    assert m["acc_at"] == pytest.approx({"0.25": 0.4, "0.5": 0.6, "0.75": 0.6, "1.0": 0.6})


def test_eval_standard_errors():
    independent, clustered = eval_standard_errors(0.5, prompts=100, samples=4)
    assert independent == pytest.approx(0.025) and clustered == pytest.approx(0.05)


# ------------------------------------------------------------------------------------ the report (no training)
def _synthetic_runs():
    ds, sara = Cell("grpo", "ds", None, "ds", "grpo-ds"), Cell("grpo", "sara", "predictive", "sara@predictive",
                                                               "grpo-sara_predictive")

    def run(seed, acc, effective=10, steps=3):
        n = len(acc)
        return {"seed": seed, "algo": "grpo", "allocator": "x", "steps": steps, "acc_before": acc[0], "acc_after": acc[-1],
                "rollouts": 300, "tokens": 3000, "effective_groups": effective, "committed_groups": 10,
                "curve": {"step": list(range(n)), "rollouts": [0, 100, 200, 300][:n],
                          "tokens": [0, 1000, 2000, 3000][:n], "wall_s": [0, 1, 2, 3][:n], "acc": acc}}

    return [(ds, run(0, [0.5, 0.55, 0.6, 0.6])), (ds, run(1, [0.5, 0.6, 0.65, 0.7])),
            (sara, run(0, [0.5, 0.6, 0.7, 0.7], effective=12, steps=4)),
            (sara, run(1, [0.5, 0.7, 0.7, 0.75], effective=6, steps=5))]


def test_matrix_outputs_are_written_atomically(tmp_path):
    """``matrix.json`` and ``matrix.md`` go through ``atomic_write``: a link planted at either is replaced, never
    followed (its target outside the directory keeps its bytes)."""
    from sara.experiments.matrix_report import analyze, write_outputs
    from sara.storage import on_write_point

    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    out = tmp_path / "m"
    out.mkdir()
    for name in ("matrix.json", "matrix.md"):
        (out / name).symlink_to(outside)
    report = analyze(_synthetic_runs(), budget=300, eval_prompts=100, eval_samples=4)
    renamed = []
    with on_write_point(lambda point, path: renamed.append(path.name) if point == "atomic.rename" else None):
        write_outputs(report, out)
    assert {"matrix.json", "matrix.md"} <= set(renamed) and outside.read_text() == "keep"
    assert not (out / "matrix.md").is_symlink() and json.loads((out / "matrix.json").read_text())["budget"] == 300


def test_report_measures_cells_over_seeds_and_writes_table_plot_json(tmp_path):
    from sara.experiments.matrix_report import analyze, format_report, write_outputs
    from sara.experiments.saving import format_ci as _ci

    report = analyze(_synthetic_runs(), budget=300, eval_prompts=100, eval_samples=4)
    assert report["algos"]["grpo"]["target"] == pytest.approx(0.65)  # DS's final accuracy, mean of its seeds
    ds, sara = report["cells"]
    assert ds["is_reference"] and not sara["is_reference"] and sara["sampler"] == "predictive"
    # DS seed 0 never reaches 0.65 (censored at 300); seed 1 reaches it at 200. SARA: 150 and 75.
    assert ds["aggregate"]["reached"] == 1 and sara["aggregate"]["reached"] == 2
    assert ds["aggregate"]["rollouts_to_target"]["mean"] == pytest.approx(250)
    assert sara["aggregate"]["rollouts_to_target"]["mean"] == pytest.approx(112.5)
    assert sara["aggregate"]["rollouts_ratio"] == pytest.approx(112.5 / 250)
    assert sara["aggregate"]["final_acc"]["half"] == pytest.approx(t_interval([0.7, 0.75])[1])
    assert [r["seed"] for r in sara["runs"]] == [0, 1] and "measures" in sara["runs"][0]
    assert sara["band"]["lo"][0] == 0.5 and sara["band"]["hi"][-1] == 0.75
    # training seconds per effective group: 3 s over 12 and over 6 groups
    assert sara["aggregate"]["wall_s_per_effective_group"]["mean"] == pytest.approx((3 / 12 + 3 / 6) / 2)
    assert ds["aggregate"]["wall_s_per_effective_group"]["mean"] == pytest.approx(0.3)
    # rollouts per effective group over all seeds (600 / 18) and the training steps the budget bought
    assert sara["aggregate"]["rollouts_per_effective_group"] == pytest.approx(600 / 18)
    assert sara["aggregate"]["steps"]["mean"] == pytest.approx(4.5) and ds["aggregate"]["steps"]["mean"] == 3
    text = format_report(report)
    assert "train s / eff. group" in text and "| 0.300 ± 0.00 |" in text  # 3 significant digits
    assert _ci({"mean": 0.01834, "half": 0.00102}, "#.3g") == "0.0183 ± 0.00102"  # the tiny policy's ~10 ms
    assert "| 33.3 | 4.5 ± " in text and "| 30.0 | 3.0 ± 0.0 |" in text
    assert "| **ds** (ref) |" in text and "1/2" in text and "2/2" in text
    assert "0.725 ± " in text and "≥ 250 ± " in text
    # every measure to target against the reference's, with the interval propagated from both means' intervals
    ref_half, own_half = t_interval([300, 200])[1], t_interval([150, 75])[1]
    want = 0.45 * math.sqrt((own_half / 112.5) ** 2 + (ref_half / 250) ** 2)
    for key in ("rollouts", "tokens", "wall_s"):  # tokens and seconds grow like rollouts in these curves
        assert sara["aggregate"][f"{key}_ratio"] == pytest.approx(0.45)
        assert sara["aggregate"][f"{key}_ratio_half"] == pytest.approx(want)
    assert text.count(f"0.45 ± {want:.2f}*") == 3  # censored: DS's seed 0 never reaches the target
    assert "0.0238" in text and "0.0477" in text  # sqrt(.65 x .35 / 400), sqrt(.65 x .35 / 100)
    paths = write_outputs(report, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert [len(c["runs"]) for c in data["cells"]] == [2, 2] and data["cells"][1]["aggregate"]["n"] == 2
    assert paths["md"].read_text() == text
    # accuracy vs training seconds: every seed's curve on one grid up to the longest run (3 s), flat after its end
    assert sara["band_seconds"]["x"][-1] == 3 and sara["band_seconds"]["hi"][-1] == 0.75
    pytest.importorskip("matplotlib")
    assert sara["band_tokens"]["x"][-1] == 3000 and sara["band_tokens"]["hi"][-1] == 0.75
    assert all(paths[key].stat().st_size > 0 for key in ("png", "png_seconds", "png_tokens"))


def test_ratio_interval_propagates_both_sides():
    from sara.bench.summary import ratio_interval

    r, half = ratio_interval({"mean": 6.0, "half": 0.6}, {"mean": 10.0, "half": 0.8})
    assert r == pytest.approx(0.6) and half == pytest.approx(0.6 * math.sqrt(0.01 + 0.0064))
    assert math.isnan(ratio_interval({"mean": 6.0, "half": math.nan}, {"mean": 10.0, "half": 0.8})[1])
    assert all(math.isnan(x) for x in ratio_interval({"mean": 6.0, "half": 0.1}, {"mean": math.nan, "half": 0.1}))


def test_the_report_says_where_the_tokens_go_by_fate():
    from sara.experiments.matrix_report import analyze, format_report

    runs = _synthetic_runs()
    assert "Where the tokens go" not in format_report(analyze(runs, budget=300))  # runs without the accounting
    for i, (_, r) in enumerate(runs):
        r["tokens_by_fate"] = {"committed": 2000, "abandoned": 600 + 100 * i, "discarded": 400 - 100 * i,
                               "aborted": 50}
        r["prompt_tokens"], r["trained_tokens"] = 9000, 1900
    report = analyze(runs, budget=300)
    ds, sara = (c["aggregate"]["tokens"] for c in report["cells"])
    # SARA: 18 effective groups over its two seeds, 6,000 generated tokens
    assert sara["generated_per_effective_group"] == pytest.approx(6000 / 18)
    assert sara["abandoned_per_effective_group"] == pytest.approx(1700 / 18)
    assert sara["aborted_per_effective_group"] == pytest.approx(100 / 18)
    assert sara["prompt_per_effective_group"] == pytest.approx(18000 / 18)
    assert ds["trained_per_effective_group"] == pytest.approx(3800 / 20) and ds["generated_per_rollout"] == 10
    text = format_report(report)
    assert "| sara@predictive | 333 | 222 | 94 | 17 | 6 | 1,000 | 211 | 10.0 |" in text


def test_the_report_says_where_the_training_seconds_go_pooled_over_seeds():
    from sara.experiments.matrix import PHASE_KEYS
    from sara.experiments.matrix_report import analyze, format_report

    runs = _synthetic_runs()
    assert "Where the training seconds go" not in format_report(analyze(runs, budget=300))  # runs without phases
    sums = [(6.0, 9.0, 12.0, 3.0, 24.0, 3.0, 4.0), (3.0, 6.0, 6.0, 3.0, 24.0, 0.0, 5.6),
            (4.0, 8.0, 20.0, 4.0, 32.0, 8.0, 6.4), (2.0, 10.0, 30.0, 5.0, 40.0, 2.0, 8.0)]
    for (_, r), values in zip(runs, sums):
        r["phases"] = dict(zip(PHASE_KEYS, values))
    report = analyze(runs, budget=300)
    ds, sara = (c["aggregate"]["phases"] for c in report["cells"])
    # SARA's seeds: 6 s of collection and 18 s of learning over 18 effective groups and 600 rollouts, 50 rounds in 9
    # steps, 10 groups left banked, reward variance weighted by 72 trained groups
    assert sara["collect_s_per_effective_group"] == pytest.approx(6 / 18)
    assert sara["learn_s_per_effective_group"] == pytest.approx(18 / 18)
    assert sara["collect_s_per_rollout"] == pytest.approx(6 / 600)
    assert sara["rollouts_per_round"] == pytest.approx(600 / 50) and sara["rounds_per_step"] == pytest.approx(50 / 9)
    assert sara["banked_per_step"] == pytest.approx(10 / 9) and sara["group_reward_var"] == pytest.approx(14.4 / 72)
    assert ds["rollouts_per_round"] == pytest.approx(600 / 18) and ds["group_reward_var"] == pytest.approx(9.6 / 48)
    text = format_report(report)
    # collection seconds per 1,000 generated tokens: 6 s over 6,000 tokens against DS's 9 s over 6,000
    assert sara["collect_s_per_token"] == pytest.approx(1e-3) and sara["collect_s_per_token_ratio"] == pytest.approx(2 / 3)
    assert "| sara@predictive | 0.333 | 1.000 | 0.0100 | 1.00 | 0.67 | 12.0 | 5.56 | 1.11 | 0.200 |" in text
    assert "| ds | 0.450 | 0.750 | 0.0150 | 1.50 | 1.00 | 33.3 | 3.00 | 0.50 | 0.200 |" in text


def test_the_report_tabulates_final_accuracy_per_band():
    from sara.experiments.matrix_report import analyze, format_report

    runs = _synthetic_runs()
    assert "per band" not in format_report(analyze(runs, budget=300))  # runs without bands
    finals = [(0.9, 0.1), (0.8, 0.3), (0.95, 0.05), (0.85, 0.15)]  # (easy, hard) after training, per run
    for (_, r), (easy, hard) in zip(runs, finals):
        r["acc_by_band"] = {"easy": (0.7, easy), "hard": (0.0, hard)}
    report = analyze(runs, budget=300)
    ds, sara = (c["aggregate"]["final_acc_by_band"] for c in report["cells"])
    assert ds["easy"]["mean"] == pytest.approx(0.85) and ds["hard"]["half"] == pytest.approx(t_interval([0.1, 0.3])[1])
    assert sara["hard"]["mean"] == pytest.approx(0.1)
    assert report["algos"]["grpo"]["start_acc_by_band"]["easy"]["mean"] == pytest.approx(0.7)
    text = format_report(report)
    assert "| cell | easy | hard |" in text and "| start | 0.700 ± 0.000 | 0.000 ± 0.000 |" in text
    assert f"| sara@predictive | 0.900 ± {t_interval([0.95, 0.85])[1]:.3f} |" in text
    runs[0][1]["acc_by_band"] = {"easy": (0.7, 0.9)}  # a run with other bands: no table
    assert "per band" not in format_report(analyze(runs, budget=300))


def test_one_seed_prints_values_without_intervals_and_a_fixed_target():
    from sara.experiments.matrix_report import analyze, format_report

    runs = [r for r in _synthetic_runs() if r[1]["seed"] == 0]
    report = analyze(runs, budget=300, target_acc=0.6)
    assert report["algos"]["grpo"]["target"] == 0.6
    text = format_report(report)
    assert "±" not in text.split("How the columns")[0].split("|---")[1] and "fixed by --target-acc" in text
    (ds,) = [c for c in report["cells"] if c["cell"] == "ds"]
    assert ds["aggregate"]["rollouts_to_target"]["mean"] == pytest.approx(200)


# ----------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_small_matrix_runs_every_cell_for_every_seed(tmp_path):
    """2 cells x 2 seeds of a tiny run (a 2-step budget of 4 groups, 40 eval prompts), in 2 worker processes."""
    pytest.importorskip("torch")
    from sara.cli import main

    out = tmp_path / "m"
    assert main(["matrix", "--quick", "--steps", "2", "--seeds", "2", "--algos", "grpo", "--allocators",
                 "ds;sara@predictive", "--set", "groups_per_step=4", "--set", "eval.num_prompts=40",
                 "--set", "eval.every=1", "--workers", "2", "--out", str(out)]) == 0
    data = json.loads((out / "matrix.json").read_text())
    assert data["seeds"] == [0, 1] and data["budget"] == 2 * 4 * 8
    ds, sara = data["cells"]
    assert (ds["cell"], sara["cell"], sara["sampler"]) == ("ds", "sara@predictive", "predictive")
    for cell in (ds, sara):
        assert [r["seed"] for r in cell["runs"]] == [0, 1] and cell["aggregate"]["n"] == 2
        for r in cell["runs"]:
            assert 0 < r["rollouts"] <= data["budget"] and r["curve"]["rollouts"][-1] == r["rollouts"]
            assert len(r["curve"]["acc"]) >= 2 and r["measures"]["final_acc"] == r["acc_after"]
            assert (out / "cells" / cell["name"] / f"seed{r['seed']}" / "metrics.jsonl").is_file()
    # the same starting weights: per seed, every cell's first evaluation (same eval seeds) is the same
    assert [r["acc_before"] for r in ds["runs"]] == [r["acc_before"] for r in sara["runs"]]
    assert data["algos"]["grpo"]["target"] == pytest.approx(sum(r["acc_after"] for r in ds["runs"]) / 2)
    assert "| **ds** (ref) |" in (out / "matrix.md").read_text()
    for cell in (ds, sara):  # where the seconds go, from the runs' metrics
        ph = cell["aggregate"]["phases"]
        assert ph["collect_s_per_effective_group"] > 0 and ph["learn_s_per_effective_group"] > 0
        assert ph["rounds_per_step"] >= 1 and 0 < ph["group_reward_var"] <= 0.25
        assert all(r["phases"]["steps"] == r["steps"] for r in cell["runs"])
    assert "Where the training seconds go" in (out / "matrix.md").read_text()


def _runs(out):
    data = json.loads((out / "matrix.json").read_text())
    return [{**r, "allocator": c["cell"], "algo": c["algo"]} for c in data["cells"] for r in c["runs"]]


@pytest.mark.slow
def test_quick_matrix_runs_all_cells_at_equal_budget(tmp_path, capsys):
    pytest.importorskip("torch")
    from sara.cli import main

    out = tmp_path / "matrix"
    assert main(["matrix", "--quick", "--algos", ";".join(ALGOS), "--allocators", ";".join(ALLOCATORS),
                 "--out", str(out)]) == 0
    results = _runs(out)
    assert sorted((r["algo"], r["allocator"]) for r in results) == sorted((a, b) for a in ALGOS for b in ALLOCATORS)
    budget = {r["rollouts"] for r in results if r["allocator"] == "uniform"}
    assert len(budget) == 1  # uniform spends exactly the budget
    b = budget.pop()
    for r in results:
        assert r["rollouts"] <= b  # nobody spends more than the shared budget
        assert r["acc_before"] == results[0]["acc_before"]  # same starting policy and eval seeds
        assert r["acc_after"] > r["acc_before"] - EVAL_SE, r  # no cell ends below its start beyond one eval's noise
        assert r["tokens"] > 0 and r["steps"] >= 1
    for algo in ALGOS:  # every algorithm learns, over its allocators
        gains = [r["acc_after"] - r["acc_before"] for r in results if r["algo"] == algo]
        assert sum(gains) / len(gains) > 2 * LOOSE_MARGIN, (algo, gains)
    by = {(r["algo"], r["allocator"]): r for r in results}
    for algo in ALGOS:  # DS and SARA train on effective groups only; uniform keeps saturated ones
        assert by[(algo, "ds")]["effective_groups"] == by[(algo, "ds")]["committed_groups"]
        assert by[(algo, "sara")]["effective_groups"] == by[(algo, "sara")]["committed_groups"]
    table = (out / "matrix.md").read_text()
    assert table.count("\n| ") >= 4 * (3 + 1) and "eff. frac" in table
    assert (out / "matrix.png").stat().st_size > 0
    assert "reinforce_pp" in capsys.readouterr().out


@pytest.mark.slow
def test_quick_matrix_runs_the_continuous_and_text_tree_allocators(tmp_path):
    """Issue 5's extension allocators are matrix cells like any other; trees on text (TreeTaskEnv) pay each branch's
    shared segment once, so at the same rollout budget they generate fewer tokens."""
    pytest.importorskip("torch")
    from sara.cli import main

    out = tmp_path / "matrix"
    specs = ["sara_continuous", "sara_tree:node_prefix=true"]
    assert main(["matrix", "--quick", "--algos", "grpo", "--allocators", ";".join(specs), "--target-acc", "0.9",
                 "--out", str(out)]) == 0
    by = {r["allocator"]: r for r in _runs(out)}
    assert set(by) == set(specs)
    for r in by.values():
        assert r["acc_after"] > r["acc_before"] + LOOSE_MARGIN, r
        assert r["effective_groups"] == r["committed_groups"] > 0
    tree, flat = by["sara_tree:node_prefix=true"], by["sara_continuous"]
    assert tree["rollouts"] == flat["rollouts"] and tree["tokens"] < 0.95 * flat["tokens"]


@pytest.mark.slow
def test_driver_stream_runs_every_cell_on_the_streaming_driver(tmp_path):
    """``--driver stream``: cells collect with the streaming driver (occupancy is only measured there); the table
    reports training seconds per effective group."""
    pytest.importorskip("torch")
    from sara.cli import main
    from sara.metrics import read_jsonl

    out = tmp_path / "matrix"
    assert main(["matrix", "--quick", "--algos", "grpo", "--allocators", "sara", "--driver", "stream",
                 "--out", str(out)]) == 0
    logs = sorted(out.glob("cells/*/seed*/metrics.jsonl"))
    assert len(logs) == 2  # sara and the reference ds
    for path in logs:
        steps = read_jsonl(path)[1:]
        assert steps and all(r["alloc/mean_inflight"] > 0 for r in steps), path
    table = (out / "matrix.md").read_text()
    assert "train s / eff. group" in table and "--set driver.barrier=false" in table


def test_the_ticker_names_the_step_each_running_run_reached(tmp_path, capsys):
    """``sara matrix``'s "running" line says where the runs in flight are (from their logs), never a finished one."""
    import json as _json
    import time as _time

    from sara.commands.output import Ticker
    from sara.experiments.matrix_runs import runs_in_progress

    def run_dir(cell, seed, records, finished=False):
        d = tmp_path / "cells" / cell / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(_json.dumps(r) + "\n" for r in records))
        if finished:
            (d / "result.json").write_text("{}")

    assert runs_in_progress(tmp_path) == ""
    run_dir("grpo-ds", 0, [{"step": 0, "env/cum_rollouts": 0}, {"step": 3, "env/cum_rollouts": 1216}])
    run_dir("grpo-sara", 0, [{"step": 2}])
    run_dir("grpo-sara", 1, [{"step": 9}], finished=True)
    (tmp_path / "cells" / "grpo-sara" / "seed2").mkdir()  # started, nothing logged yet
    (tmp_path / "cells" / "grpo-sara" / "seed2" / "metrics.jsonl").write_bytes(b"\xff[[[")  # data, not code
    assert runs_in_progress(tmp_path) == "grpo-ds seed 0: step 3, 1,216 rollouts; grpo-sara seed 0: step 2"
    with Ticker("sara matrix", every=0.05, detail=lambda: runs_in_progress(tmp_path)):
        _time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("[sara matrix] running, ") for line in lines)
    assert lines[0].endswith("; grpo-ds seed 0: step 3, 1,216 rollouts; grpo-sara seed 0: step 2")
