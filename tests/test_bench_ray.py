"""``sara bench ray scaling`` and ``sara bench ray stream`` end to end on a tiny workload (one local Ray cluster for
the module): exit code, table and JSON keys; the streamed completions equal the rounds' (checked by the bench)."""

from __future__ import annotations

import json

import pytest

from sara.cli import main

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def cluster():
    from sara.backends.ray import init_ray

    started = init_ray(num_cpus=2)
    yield
    if started:
        ray.shutdown()


def test_bench_ray_scaling(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    assert main(["bench", "ray", "scaling", "--workers", "1,2", "--steps", "1", "--target", "4", "--pool-size", "500",
                 "--seconds-per-token", "1e-6", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["workers"], r["balance"]) for r in report["rows"]] == [(1, "tokens"), (2, "tokens"), (2, "requests")]
    assert {"seconds", "rollouts", "tokens", "rollouts_per_s", "tokens_per_s", "speedup"} <= set(report["rows"][0])
    assert report["rows"][0]["speedup"] == 1.0
    assert len({(r["rollouts"], r["tokens"]) for r in report["rows"]}) == 1  # the same steps on every pool
    assert "split by" in capsys.readouterr().out
    assert ray.is_initialized()  # a cluster the bench did not start is left running


def test_bench_ray_stream(tmp_path):
    out = tmp_path / "stream.json"
    assert main(["bench", "ray", "stream", "--workers", "2", "--slots", "2", "--completions", "12", "--tick-s",
                 "0.001", "--max-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"workers", "slots", "completions", "tokens", "tick_s", "rounds_seconds", "stream_seconds",
                           "speedup"}
    assert (report["workers"], report["slots"], report["completions"]) == (2, 4, 12)


def test_bench_ray_bad_workers_is_a_config_error(capsys):
    assert main(["bench", "ray", "scaling", "--workers", "1,x"]) == 2
    assert "field 'workers'" in capsys.readouterr().err
