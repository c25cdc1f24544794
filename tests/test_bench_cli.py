"""Every ``sara bench`` subcommand end to end through the command line on a tiny workload: its exit code, its table
and its JSON keys; every option of every command has help text; bad values are one-line errors naming the field.

``sara bench ray`` is in tests/test_bench_ray.py (it starts a Ray cluster)."""

from __future__ import annotations

import argparse
import json

import pytest

from sara.cli import build_parser, main

TINY_TASK = "sara/Arithmetic-v0:max_digits=2,ops=+,pool_size=5000"  # the tiny policy's task (cached warm start)


def _parsers(parser: argparse.ArgumentParser, path: str = "sara"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_of_every_command_has_help_text():
    missing = [f"{path} {'/'.join(a.option_strings)}" for path, p in _parsers(build_parser()) for a in p._actions
               if a.option_strings and a.help in (None, "") and a.dest != "help"]
    assert not missing, "options without help: " + ", ".join(missing)
    bench = dict(_parsers(build_parser()))
    for name in ("allocation", "decisions", "soak", "generation", "stream", "ray scaling", "ray stream"):
        assert "--json" in bench[f"sara bench {name}"]._option_string_actions, f"sara bench {name} has no --json"


def _json(path):
    return json.loads(path.read_text())


def test_bench_allocation(tmp_path, capsys):
    out = tmp_path / "alloc.json"
    assert main(["bench", "allocation", "--k", "4", "--target-groups", "8", "--seeds", "1", "--pool-size", "400",
                 "--allocators", "uniform;ds;sara", "--json", str(out), "--plot", str(tmp_path / "a.png")]) == 0
    report = _json(out)
    assert [r["allocator"] for r in report["results"]] == ["uniform", "ds", "sara"]
    assert {"rollouts_per_effective_group", "ratio_vs_ds"} <= set(report["results"][0])
    assert "sara" in capsys.readouterr().out


def test_bench_decisions(tmp_path, capsys):
    out = tmp_path / "dec.json"
    assert main(["bench", "decisions", "--units", "2000", "--rounds", "2", "--json", str(out)]) == 0
    report = _json(out)
    assert report["allocator"] == "sara" and report["units"] == 2000 and report["decisions"] > 0
    assert {"decisions_per_second", "decisions_per_second_with_dispatch"} <= set(report)
    table = capsys.readouterr().out.split("\n\nJSON:")[0]  # a table on stdout, the JSON in the file
    rows = dict(tuple(c.strip() for c in line.strip("|").split("|")) for line in table.splitlines()[2:])
    assert rows["decisions"] == f"{report['decisions']:,}" and rows["allocator"] == "sara"


def test_bench_soak(tmp_path, capsys):
    out = tmp_path / "soak.json"
    assert main(["bench", "soak", "--steps", "12", "--pool-size", "2000", "--seed", "1", "--json", str(out)]) == 0
    report = _json(out)
    assert report["steps"] == 12 and report["ok"] + report["failed"] == 12
    assert {"rollouts", "failed_rollouts", "committed_groups", "stop_reasons", "allocators", "rss_growth_mb",
            "rss_peak_mb", "seconds"} <= set(report)
    capsys.readouterr()
    assert main(["bench", "soak", "--fault-rate", "1.5"]) == 2
    assert "field 'fault_rate'" in capsys.readouterr().err


def test_bench_soak_reports_a_broken_accounting_as_a_failure(monkeypatch, capsys):
    import sara.bench.soak as soak

    real = soak._FaultyEnv.rollout

    def leaky(self, requests):
        out = real(self, requests)
        self.generated += 1  # under-reports what it generated
        return out

    monkeypatch.setattr(soak._FaultyEnv, "rollout", leaky)
    assert main(["bench", "soak", "--steps", "3", "--pool-size", "500", "--fault-rate", "0"]) == 1
    assert "bench soak failed" in capsys.readouterr().err


def test_bench_generation(tmp_path, capsys):
    out = tmp_path / "gen.json"
    assert main(["bench", "generation", "--allocators", "ds;sara+fill", "--groups", "2", "--k", "4", "--steps", "1",
                 "--slots", "16", "--task", TINY_TASK, "--json", str(out)]) == 0
    report = _json(out)
    assert [(r["allocator"], r["driver"]) for r in report["results"]] == [("ds", "sync"), ("sara", "fill")]
    assert {"tokens_per_second", "full_batch_tokens_per_second", "throughput_ratio", "mean_inflight"} <= set(
        report["results"][1])
    assert "| `sara` | fill |" in capsys.readouterr().out


STREAM_KEYS = {"tokens", "seconds", "tokens_per_second", "ratio_vs_one_batch", "same_tokens"}


def test_bench_stream_on_the_tiny_backend(tmp_path, capsys):
    out = tmp_path / "stream.json"
    assert main(["bench", "stream", "--rows", "12", "--prompts", "3", "--slots", "4", "--caps", "2,10",
                 "--check-exact", "--json", str(out)]) == 0
    report = _json(out)
    assert (report["rows"], report["slots"], report["capacity"], report["max_new_tokens"]) == (12, 4, 12, 10)
    assert set(report["passes"]) == {"one_batch", "rounds", "stream", "stream_all"}
    for row in report["passes"].values():
        assert set(row) == STREAM_KEYS and row["same_tokens"] == "12/12"  # the tiny engine honours seeds
    # the same completions whichever way: the same tokens
    assert len({row["tokens"] for row in report["passes"].values()}) == 1
    assert report["exact"] == "16/16" and report["stream_vs_one_batch"] == report["passes"]["stream"][
        "ratio_vs_one_batch"]
    table = capsys.readouterr().out
    assert "| stream_all |" in table and "float32 streamed == generate: 16/16" in table


@pytest.mark.parametrize("argv, field", [
    (["--caps", "10,2"], "caps"),
    (["--caps", "7"], "caps"),
    (["--rows", "0"], "rows"),
    (["--backend", "nope"], "backend"),
    (["--random-init"], "random_init"),  # the tiny backend has no random weights to draw
])
def test_bench_stream_errors_name_the_field(argv, field, capsys):
    assert main(["bench", "stream", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sara: error:") and f"field '{field}'" in err


def test_bench_stream_needs_a_streaming_backend():
    from sara.bench.stream import run_stream_bench
    from sara.config import ConfigError
    from sara.envs.tasks import make_task

    class Rounds:
        def generate(self, requests, sampling):
            return [[] for _ in requests]

    with pytest.raises(ConfigError, match="field 'backend'.*cannot stream"):
        run_stream_bench({"rows": 4}, backend=Rounds(), task=make_task(TINY_TASK))


@pytest.mark.hf
def test_bench_stream_on_hf_with_random_weights(tmp_path):
    out = tmp_path / "hf.json"
    assert main(["bench", "stream", "--backend", "hf:dtype=float32", "--random-init", "--rows", "6", "--prompts",
                 "2", "--slots", "3", "--caps", "2,6", "--json", str(out)]) == 0
    report = _json(out)
    assert report["capacity"] == 6 and all(row["same_tokens"] == "6/6" for row in report["passes"].values())
