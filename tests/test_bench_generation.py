"""``sara bench generation``: spec parsing, the JSON report's fields and ratios, and the errors it names.

Tiny configurations (a few groups, one or two steps) on the tiny backend. No wall-clock assertions: only the report's
structure and the ratios' consistency.
"""

from __future__ import annotations

import json
import math

import pytest

from sara.bench.generation import format_table, parse_allocators, run_generation_bench
from sara.config import ConfigError

FIELDS = ("allocator", "driver", "tokens_per_second", "full_batch_tokens_per_second", "throughput_ratio",
          "seconds_per_effective_group", "wall_ratio_vs_ds", "rollouts_per_effective_group", "ratio_vs_ds",
          "mean_inflight", "aborted_rollouts", "tokens", "rollouts", "effective_groups", "wall_seconds")
TASK = "sara/Arithmetic-v0:max_digits=2,ops=+,pool_size=5000"  # the tiny policy's default task (cached warm start)


def test_parse_allocators_splits_on_semicolons_and_reads_the_stream_suffix():
    assert parse_allocators("ds;sara_paper:tau_low=0.3,probe=2/1;sara+stream") == [
        ("ds", "sync"), ("sara_paper:tau_low=0.3,probe=2/1", "sync"), ("sara", "stream")]
    assert parse_allocators(" sara:probe=4 +stream ; ds ;") == [("sara:probe=4", "stream"), ("ds", "sync")]
    assert parse_allocators("sara+carry;ds") == [("sara", "carry"), ("ds", "sync")]
    assert parse_allocators("sara+fill+carry;sara+fill") == [("sara", "fill+carry"), ("sara", "fill")]
    for bad in ("", ";", "ds;;sara", "+stream", "+carry", "sara+fast"):
        with pytest.raises(ConfigError, match="field 'allocators'"):
            parse_allocators(bad)


def test_unknown_backend_and_bad_fields_are_config_errors():
    with pytest.raises(ConfigError, match="field 'backend'.*unknown backend 'nope'"):
        run_generation_bench(dict(backend="nope"))
    with pytest.raises(ConfigError, match="field 'groups'"):
        run_generation_bench(dict(groups=0))
    with pytest.raises(ConfigError, match="field 'allocators'"):
        run_generation_bench(dict(allocators=[]))


class _PlainBackend:
    """A backend without the streaming API (generate only)."""

    def __init__(self, inner):
        self.inner = inner

    def generate(self, requests, sampling):
        return self.inner.generate(requests, sampling)

    def update_weights(self, state_dict, version):
        self.inner.update_weights(state_dict, version)

    def close(self):
        self.inner.close()


@pytest.fixture(scope="module")
def tiny():
    from sara.backends import make_backend
    from sara.envs.tasks import make_task
    from sara.policies import POLICIES

    task = make_task(TASK)
    backend = make_backend("tiny", POLICIES.get("tiny")({}, task=task, seed=0))
    yield task, backend
    backend.close()


def test_a_streaming_spec_on_a_backend_that_cannot_stream_names_the_field(tiny):
    task, backend = tiny
    with pytest.raises(ConfigError, match="field 'allocators'.*'sara\\+stream'.*cannot stream"):
        run_generation_bench(dict(allocators=["ds", "sara+stream"], groups=2, k=4, steps=1), backend=_PlainBackend(
            backend), task=task)


def _check_report(report, specs):
    assert set(report) == {"backend", "task", "config", "results"}
    assert json.loads(json.dumps(report)) == report  # plain JSON
    assert [r["allocator"] + ("" if r["driver"] == "sync" else f"+{r['driver']}") for r in report["results"]] == specs
    for r in report["results"]:
        assert set(FIELDS) <= set(r), set(FIELDS) - set(r)
        assert r["tokens"] > 0 and r["rollouts"] > 0 and r["wall_seconds"] > 0 and r["effective_groups"] > 0
        assert math.isclose(r["throughput_ratio"], r["tokens_per_second"] / r["full_batch_tokens_per_second"])
        assert math.isclose(r["tokens_per_second"], r["tokens"] / r["wall_seconds"])
        assert math.isclose(r["seconds_per_effective_group"], r["wall_seconds"] / r["effective_groups"])
        assert math.isclose(r["rollouts_per_effective_group"], r["rollouts"] / r["effective_groups"])
        assert r["full_batch_tokens"] > 0 and r["mean_inflight"] > 0
    ds = report["results"][0]
    assert ds["allocator"] == "ds" and ds["wall_ratio_vs_ds"] == 1.0 and ds["ratio_vs_ds"] == 1.0
    for r in report["results"]:
        assert math.isclose(r["wall_ratio_vs_ds"], r["seconds_per_effective_group"] / ds["seconds_per_effective_group"])
        assert math.isclose(r["ratio_vs_ds"], r["rollouts_per_effective_group"] / ds["rollouts_per_effective_group"])
    table = format_table(report)
    assert table.count("\n| `") == len(specs)


def test_sync_report_on_the_tiny_backend(tiny):
    """Synchronous drivers: the full batch regenerates the very same tokens (per-completion seeds), nothing is
    aborted."""
    task, backend = tiny
    specs = ["ds", "sara_paper:tau_low=0.45"]
    report = run_generation_bench(dict(allocators=specs, groups=2, k=4, steps=2, task=TASK), backend=backend, task=task)
    _check_report(report, specs)
    assert report["task"] == TASK and report["config"]["groups"] == 2
    for r in report["results"]:
        assert r["driver"] == "sync" and r["aborted_rollouts"] == 0
        assert r["full_batch_tokens"] == r["tokens"]  # same prompts + seeds, re-batched: the same completions


def test_default_run_on_the_tiny_backend_streams(tiny):
    """The default comparison (ds; sara; sara+stream; sara+carry) built from the config alone: the streaming entries
    are driven by the streaming driver (their tokens include the aborted rollouts' partial tokens). (That carrying keeps
    the engine busier is tested deterministically in tests/test_stream_carry.py; here occupancy is wall-weighted.)"""
    report = run_generation_bench(dict(groups=2, k=4, steps=2))
    _check_report(report, ["ds", "sara", "sara+stream", "sara+carry"])
    stream, carry = report["results"][2:]
    assert stream["driver"] == "stream" and stream["aborted_tokens"] <= stream["tokens"]
    assert carry["driver"] == "carry" and carry["mean_inflight"] > 0
    assert carry["aborted_tokens"] <= carry["tokens"]


def test_a_carrying_spec_leaves_nothing_running_and_regenerates_what_it_delivered(tiny):
    task, backend = tiny
    report = run_generation_bench(dict(allocators=["ds", "sara+carry"], groups=2, k=4, steps=3, task=TASK),
                                  backend=backend, task=task)
    _check_report(report, ["ds", "sara+carry"])
    assert backend.inflight() == 0  # the last step's carry was aborted (and counted)
    carry = report["results"][1]
    # every delivered rollout is regenerated in the full batches (the last step carries nothing over)
    assert 0 < carry["full_batch_tokens"] <= carry["tokens"]


def test_seeds_are_pooled_with_paired_intervals_against_the_reference(tiny):
    """Two seeds: totals are sums over the seeds, the ratios are ratios of pooled rates, each ratio has a 95% interval
    over the per-seed ratios, and the reference is 1.0 against itself at every seed."""
    task, backend = tiny
    specs = ["ds", "sara", "sara+stream"]
    one = [run_generation_bench(dict(allocators=specs, groups=2, k=4, steps=2, task=TASK, seed=s), backend=backend,
                                task=task)["results"] for s in (3, 4)]
    report = run_generation_bench(dict(allocators=specs, groups=2, k=4, steps=2, task=TASK, seed=3, seeds=2,
                                       reference="sara"), backend=backend, task=task)
    _check_report(report, specs)
    for i, r in enumerate(report["results"]):
        assert [p["seed"] for p in r["per_seed"]] == [3, 4]
        for key in ("rollouts", "effective_groups", "aborted_rollouts"):
            assert r[key] == one[0][i][key] + one[1][i][key]  # the same runs as two single-seed ones
        for p, alone in zip(r["per_seed"], (one[0][i], one[1][i])):
            assert p["rollouts_per_effective_group"] == alone["rollouts_per_effective_group"]
        assert set(r["ci95"]) == {"throughput_ratio", "wall_ratio_vs_ds", "ratio_vs_ds", "ratio_vs_reference",
                                  "full_ratio_vs_reference"}
        assert r["ci95"]["ratio_vs_ds"] is not None and r["ci95"]["ratio_vs_ds"] >= 0
    ref = report["results"][1]
    assert ref["ratio_vs_reference"] == 1.0 and [p["ratio_vs_reference"] for p in ref["per_seed"]] == [1.0, 1.0]
    assert ref["ci95"]["ratio_vs_reference"] == 0.0
    assert math.isclose(report["results"][2]["ratio_vs_reference"],
                        report["results"][2]["rollouts_per_effective_group"] / ref["rollouts_per_effective_group"])
    assert "vs `sara`" in format_table(report) and "± " in format_table(report)


def test_full_size_groups_are_counted_apart_from_partial_ones(tiny):
    """A streaming step commits the groups still filling when its target is reached as they are; the report counts
    effective groups of the full size k separately (synchronous rounds fill every committed group)."""
    task, backend = tiny
    report = run_generation_bench(dict(allocators=["sara", "sara+fill"], groups=4, k=4,
                                       steps=2, task=TASK), backend=backend, task=task)
    sync, stream = report["results"]
    assert sync["full_groups"] == sync["effective_groups"] > 0
    assert math.isclose(sync["rollouts_per_full_group"], sync["rollouts_per_effective_group"])
    assert 0 < stream["full_groups"] < stream["effective_groups"]  # work-conserving streaming leaves partial groups
    assert math.isclose(stream["rollouts_per_full_group"], stream["rollouts"] / stream["full_groups"])


def test_a_reference_that_is_not_one_of_the_allocators_is_a_config_error():
    with pytest.raises(ConfigError, match="reference"):
        run_generation_bench(dict(allocators=["ds", "sara"], reference="sara+stream"))



def test_cli_prints_one_error_line_for_a_bad_backend_or_spec_list(capsys):
    from sara.cli import main

    assert main(["bench", "generation", "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sara: error:") and "field 'backend'" in err and "tiny, hf, vllm" in err
    assert main(["bench", "generation", "--allocators", "ds;;sara"]) == 2
    assert "field 'allocators'" in capsys.readouterr().err


def test_allocators_are_composed_with_the_pool_as_in_training():
    """The bench wires allocator and sampler as sara.train does (``compose`` with the pool): on a mixture pool,
    ``sara`` splits its population prior by component."""
    from types import SimpleNamespace

    from sara.bench.generation import GenerationBenchConfig, _Run
    from sara.envs.tasks import make_task
    from sara.priors.grouped import GroupedGridPrior

    task = make_task("sara/Mixture-v0:components=arithmetic-bands,pool_size=200,eval_size=20")
    run = _Run(GenerationBenchConfig(allocators=["sara"]), "sara", "sync", SimpleNamespace(prompts=task.prompts), 0)
    prior = run.allocator.prior
    assert isinstance(getattr(prior, "base", prior), GroupedGridPrior)


def test_a_ds_spec_with_options_is_the_ds_reference(tiny):
    task, backend = tiny
    report = run_generation_bench(dict(allocators=["ds:max_gen_batches=64", "sara"], groups=2, k=4, steps=1, task=TASK),
                                  backend=backend, task=task)
    ds, sara = report["results"]
    assert ds["wall_ratio_vs_ds"] == 1.0 and ds["ratio_vs_ds"] == 1.0
    assert sara["ratio_vs_ds"] is not None and sara["wall_ratio_vs_ds"] is not None


def test_the_tiny_policy_is_the_one_training_starts_from(monkeypatch):
    """The bench warm-starts the tiny policy as ``sara train`` does (``TINY_POLICY_OPTIONS``: to a loss, the same
    competence on any CPU), so its rollout counts describe the policy a run trains."""
    import sara.policies
    from sara.train.config import TINY_POLICY_OPTIONS

    seen = {}

    def factory(options, *, task, seed, **_):
        seen["options"] = options
        raise RuntimeError("stop here")

    monkeypatch.setitem(sara.policies.POLICIES._items, "tiny", factory)
    with pytest.raises(RuntimeError, match="stop here"):
        run_generation_bench(dict(backend="tiny", task=TASK, groups=2, steps=1))
    assert seen["options"] == TINY_POLICY_OPTIONS


def test_no_stop_drops_the_task_stop_strings(tiny):
    """``task_stop=False`` (``--no-stop``) drops the task's stop strings: the backend sees none and completions run
    on past them (to EOS or the cap)."""
    import dataclasses

    task, backend = tiny
    digits = tuple("0123456789")  # any digit stops: an arithmetic completion writes one before the cap
    stopped = dataclasses.replace(task, stop=digits)
    seen: list[tuple[str, ...]] = []

    class _Recording(_PlainBackend):
        def generate(self, requests, sampling):
            seen.append(tuple(sampling.stop))
            return super().generate(requests, sampling)

    cfg = dict(allocators=["ds"], groups=2, k=4, steps=1, task=TASK, max_new_tokens=6)
    with_stop = run_generation_bench(cfg, backend=_Recording(backend), task=stopped)
    assert set(seen) == {digits}
    seen.clear()
    without = run_generation_bench({**cfg, "task_stop": False}, backend=_Recording(backend), task=stopped)
    assert set(seen) == {()}
    a, b = with_stop["results"][0], without["results"][0]
    assert b["tokens"] / b["rollouts"] > a["tokens"] / a["rollouts"]
