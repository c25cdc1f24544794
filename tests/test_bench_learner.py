"""``sara bench learner`` end to end on a tiny random Llama (SmolLM2's tokenizer): the command runs both paths in one
run and writes the JSON report with the speedup, per-rollout and per-token seconds, FLOPs and the matmul rates."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.isa  # results depend on the CPU's kernels: .ci/run runs these under AVX2 too

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
    mem = report["memory"]  # Linux: the timed updates' own peak, not the process's since start
    assert 0 < mem["resting_mb"] <= mem["update_peak_mb"]
    assert "speedup" in capsys.readouterr().out


def test_the_peak_can_be_restarted_below_an_earlier_high_water_mark():
    import numpy as np

    from sara.memory import peak_rss_mb, reset_peak_rss, rss_mb, window_peak_mb

    block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB touched, then freed (mapped: it leaves the resident set)
    del block
    high = peak_rss_mb()
    if not reset_peak_rss():
        pytest.skip("this platform cannot reset the peak resident size")
    assert window_peak_mb() < high - 32
    assert abs(window_peak_mb() - rss_mb()) < 32
    assert peak_rss_mb() >= high  # the process's peak keeps the mark the reset cleared


def test_a_bad_option_is_one_error_line(capsys):
    from sara.cli import main

    assert main(["bench", "learner", "--groups", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "groups" in err[0]


def test_a_train_config_gives_the_batch_and_no_naive_times_the_shipped_path_alone(tiny_model_dir, tmp_path, capsys):
    """``--config`` benches the batch a ``sara train`` config trains on (flags override it); ``--no-naive`` leaves
    the naive path untimed."""
    from sara.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(f"policy: hf\npolicy_options: {{model: {tiny_model_dir}, compute_dtype: float32}}\n"
                      "task: 'sara/Chain-v0:max_steps=2,pool_size=20,eval_size=5,shots=1'\nk: 2\ngroups_per_step: 3\n"
                      "max_new_tokens: 4\nalgo: rloo\noptim: {lr: 1.0e-5, microbatch_tokens: 512}\nseed: 3\n")
    out = tmp_path / "learner.json"
    assert main(["bench", "learner", "--config", str(config), "--groups", "2", "--reps", "1", "--no-naive",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    cfg = report["config"]
    assert (cfg["model"], cfg["groups"], cfg["k"], cfg["max_new_tokens"], cfg["algo"]) == (
        str(tiny_model_dir), 2, 2, 4, "rloo")
    assert (cfg["compute_dtype"], cfg["microbatch_tokens"], cfg["lr"], cfg["seed"], cfg["naive"]) == (
        "float32", 512, 1e-5, 3, False)
    assert cfg["task"].startswith("sara/Chain-v0") and report["rollouts"] == 4
    assert report["naive"] is None and report["speedup"] is None and report["shipped"]["seconds"] > 0
    assert report["limit_dtype"] == "float32"
    assert "naive    not timed" in capsys.readouterr().out


def test_a_config_whose_policy_is_not_hf_is_refused(tmp_path, capsys):
    from sara.cli import main

    config = tmp_path / "run.yaml"
    config.write_text("policy: tiny\n")
    assert main(["bench", "learner", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "policy: hf" in err[0]


def test_the_matmul_rate_fits_its_time_budget(monkeypatch):
    """A slow dtype is measured on smaller matrices: the side grows only while ``reps + 1`` calls fit the budget."""
    import torch

    import sara.bench.learner as bench

    sides: list[int] = []
    real_randn = torch.randn

    def randn(n, m, generator=None):
        sides.append(n)
        return real_randn(n, m, generator=generator)

    clock = iter(float(t) for t in range(10_000))  # every call of the clock moves it by one second
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(torch, "randn", randn)
    # The probe's call "takes" 1 s at 256: 2 * 256^3 FLOP/s; 512 would need (3 + 1) * 8 s > 20 s, so it stays at 256.
    assert bench.matmul_gflops(2048, torch.float32, reps=3, max_seconds=20.0) == pytest.approx(2 * 256**3 / 1e9)
    assert max(sides) == 256
    sides.clear()  # a budget of 40 s lets it double once (4 calls x 8 s), never past the cap
    bench.matmul_gflops(2048, torch.float32, reps=3, max_seconds=40.0)
    assert max(sides) == 512
    sides.clear()
    bench.matmul_gflops(300, torch.float32, reps=3, max_seconds=1e9)
    assert max(sides) == 256  # at most `size` (a power-of-two multiple of 256 within it)
