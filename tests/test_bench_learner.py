"""``sara bench learner`` end to end on a tiny random Llama (SmolLM2's tokenizer): the command runs both paths in one
run and writes the JSON report with the speedup, per-rollout and per-token seconds, FLOPs and the matmul rates."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_the_command_writes_the_report(tiny_model_dir, tmp_path, capsys):
    from sara.cli import main

    out = tmp_path / "learner.json"
    assert main(["bench", "learner", "--model", str(tiny_model_dir), "--groups", "2", "--k", "3", "--reps", "1",
                 "--max-new-tokens", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"rollouts", "tokens", "response_tokens", "matmul_gflops", "flops", "naive", "shipped", "speedup",
            "limit_seconds", "over_limit", "limit_dtype", "config"} <= set(report)
    assert report["rollouts"] == 6 and report["tokens"] > report["response_tokens"] > 0
    assert set(report["matmul_gflops"]) == {"float32", "bfloat16"} and min(report["matmul_gflops"].values()) > 0
    for path in ("naive", "shipped"):
        r = report[path]
        assert r["seconds"] > 0 and len(r["seconds_all"]) == 1
        assert r["seconds_per_rollout"] == pytest.approx(r["seconds"] / 6)
        assert r["seconds_per_token"] == pytest.approx(r["seconds"] / report["tokens"])
    assert report["speedup"] == pytest.approx(report["naive"]["seconds"] / report["shipped"]["seconds"])
    flops = report["flops"]
    assert flops["naive"] > flops["shipped"] >= flops["needed"] > 0  # the shipped path skips work, not the needed
    assert report["over_limit"] == pytest.approx(report["shipped"]["seconds_min"] / report["limit_seconds"])
    assert "speedup" in capsys.readouterr().out


def test_a_bad_option_is_one_error_line(capsys):
    from sara.cli import main

    assert main(["bench", "learner", "--groups", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "groups" in err[0]
