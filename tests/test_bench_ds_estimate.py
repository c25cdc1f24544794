"""``sara bench ds-estimate``: each spec's 'DS would have spent' estimate beside a real DS run of the same config."""

from __future__ import annotations

import json

import pytest

from sara.bench.ds_estimate import DSEstimateBenchConfig, format_table, run_ds_estimate_bench, summarize
from sara.config import ConfigError, validate_config

FAST = ["steps=2", "groups_per_step=4", "eval.num_prompts=20", "eval.samples=1", "eval.greedy=false", "threads=1"]


def test_the_estimate_sits_beside_a_real_ds_run_of_the_same_steps(tmp_path):
    report = run_ds_estimate_bench(DSEstimateBenchConfig(allocators=["sara", "sara_paper@predictive"], seeds=1,
                                                         overrides=FAST))
    runs = {r["spec"]: r for r in report["runs"]}
    assert set(runs) == {"ds", "sara", "sara_paper@predictive"}
    ds = runs["ds"]
    assert ds["steps"] == 2 and ds["effective_groups"] >= 8 and "error" not in ds
    for spec in ("sara", "sara_paper@predictive"):
        r = runs[spec]
        assert r["steps"] == 2 and r["rollouts"] > 0
        assert r["ds_real_per_effective_group"] == pytest.approx(ds["rollouts"] / ds["effective_groups"])
        assert r["estimate_per_effective_group"] == pytest.approx(report["k"] / r["p_mixed"])
        assert r["estimate_per_effective_group"] * r["effective_groups"] == pytest.approx(r["ds_rollouts_estimate"])
        assert r["error"] == pytest.approx(r["estimate_per_effective_group"] / r["ds_real_per_effective_group"] - 1)
        assert r["saved_real"] == pytest.approx(1 - r["rollouts_per_effective_group"] / r["ds_real_per_effective_group"])
    table = format_table(report)
    assert "`sara_paper@predictive`" in table and "DS real" in table
    json.dumps(report)  # the report is JSON as --json writes it


def test_summary_means_and_extremes():
    runs = [{"spec": "ds"}] + [
        {"spec": "a", "error": e, "estimate_per_effective_group": 10 + e, "ds_real_per_effective_group": 10.0,
         "saved_estimated": 0.2, "saved_real": 0.1, "rollouts_per_effective_group": 8.0} for e in (-0.1, 0.3)]
    s = summarize(runs, ["a"])["a"]
    assert s["error"] == pytest.approx(0.1) and s["error_min"] == -0.1 and s["error_max"] == 0.3 and s["seeds"] == 2


def test_options_are_bounded_and_named():
    with pytest.raises(ConfigError, match="seeds"):
        validate_config(DSEstimateBenchConfig, {"seeds": 0}, what="bench ds-estimate")
    with pytest.raises(ConfigError, match="allocators"):
        validate_config(DSEstimateBenchConfig, {"allocators": []}, what="bench ds-estimate")


def test_the_cli_names_it(run_cli):
    rc, err = run_cli(["bench", "ds-estimate", "--seeds", "0"])
    assert rc != 0 and any("seeds" in line for line in err)
