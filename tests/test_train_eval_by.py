"""Held-out accuracy per prompt label (``EvalConfig.by``): a mixture pool's evaluation reports every component, their
prompt-weighted mean is the overall accuracy, and ``by=None`` or a pool without the key reports none."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from sara.train import TrainConfig, Trainer  # noqa: E402

MIX = "sara/Mixture-v0:components=a=sara/Arithmetic-v0(max_digits=1;ops=+)@0.5|b=sara/Arithmetic-v0(min_digits=2;max_digits=2;ops=+)@0.5,pool_size=40,eval_size=12"


def _evaluate(tmp_path, task, **eval_opts):
    cfg = TrainConfig(task=task, k=4, groups_per_step=2, steps=1, threads=1, progress=False, tensorboard=False,
                      out_dir=str(tmp_path), eval={"num_prompts": 12, "samples": 2, "greedy": False, **eval_opts},
                      policy_options={"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}})
    with Trainer(cfg) as trainer:
        prompts = trainer.eval_env.prompts[:12]
        return trainer.evaluate(), prompts


def test_a_mixture_pool_reports_accuracy_per_component(tmp_path):
    out, prompts = _evaluate(tmp_path, MIX)
    labels = [p.metadata.get("component") for p in prompts]
    per = {k.rsplit("/", 1)[1]: v for k, v in out.items() if k.startswith("eval/acc_sample/")}
    assert set(per) == {"a", "b"} == set(labels)
    share = {n: labels.count(n) / len(labels) for n in per}
    assert sum(per[n] * share[n] for n in per) == pytest.approx(out["eval/acc_sample"])
    assert all(0.0 <= v <= 1.0 for v in per.values())


@pytest.mark.parametrize("task,opts", [(MIX, {"by": None}),
                                       ("sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=12", {"by": "component"})])
def test_no_labels_no_per_label_metrics(tmp_path, task, opts):
    out, _ = _evaluate(tmp_path, task, **opts)
    assert "eval/acc_sample" in out and not [k for k in out if k.startswith("eval/acc_sample/")]
    assert np.isfinite(out["eval/acc_sample"])
    assert out["time/eval"] > 0 and (out["sys/peak_rss_mb/eval"] > 10 or np.isnan(out["sys/peak_rss_mb/eval"]))


def test_length_labels_by_value_and_in_bins():
    from types import SimpleNamespace

    from sara.train.evaluate import _by_label

    few = [SimpleNamespace(prompt="x" * n, metadata={}) for n in (3, 3, 4, 10, 10, 10)]
    acc = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    out = _by_label(few, acc, "<length>")
    assert _by_label(few, acc, "level|<length>") == out and _by_label(few, acc, "level") == {}  # first that labels
    assert list(out) == ["eval/acc_sample/3", "eval/acc_sample/4", "eval/acc_sample/10"]  # numeric order
    assert out["eval/acc_sample/3"] == 0.5 and out["eval/acc_sample/10"] == pytest.approx(1 / 3)
    many = [SimpleNamespace(prompt="x" * n, metadata={}) for n in range(1, 61)]
    out = _by_label(many, np.arange(60) / 59, "<length>")
    names = [k.rsplit("/", 1)[1] for k in out]
    assert len(names) == 6 and names[0].startswith("1-") and names[-1].endswith("-60")
    bounds = [tuple(map(int, n.split("-"))) for n in names]
    assert all(lo <= hi for lo, hi in bounds) and all(a[1] < b[0] for a, b in zip(bounds, bounds[1:]))  # disjoint
    assert out[f"eval/acc_sample/{names[0]}"] < out[f"eval/acc_sample/{names[-1]}"]


def test_the_default_labels_a_pool_without_components_by_length(tmp_path):
    """``by="component|<length>"`` (the default): no prompt has a component, so the prompt length labels them."""
    from sara.priors.features import prompt_length

    out, prompts = _evaluate(tmp_path, "sara/Arithmetic-v0:max_digits=2,ops=+,pool_size=40,eval_size=12")
    per = {int(k.rsplit("/", 1)[1]): v for k, v in out.items() if k.startswith("eval/acc_sample/")}
    lengths = [prompt_length(p) for p in prompts]
    assert set(per) == set(lengths) and len(per) >= 2  # few distinct lengths: one label per length
    assert sum(per[n] * lengths.count(n) / len(lengths) for n in per) == pytest.approx(out["eval/acc_sample"])


def test_the_run_summary_reports_each_band_before_and_after(tmp_path):
    """``RunSummary.acc_by_band`` holds every label's first and last held-out accuracy; ``sara train`` prints them."""
    from sara.commands.train import format_summary

    cfg = TrainConfig(task=MIX, k=4, groups_per_step=2, steps=1, threads=1, progress=False, tensorboard=False,
                      out_dir=str(tmp_path), eval={"num_prompts": 12, "samples": 2, "greedy": False},
                      policy_options={"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}})
    with Trainer(cfg) as trainer:
        summary = trainer.train()
        first, last = trainer.evals[0], trainer.evals[-1]
    assert set(summary.acc_by_band) == {"a", "b"}
    assert all(summary.acc_by_band[n] == (first[f"eval/acc_sample/{n}"], last[f"eval/acc_sample/{n}"]) for n in "ab")
    row = next(ln for ln in format_summary(summary, k=4).splitlines() if "per band" in ln)
    assert "a: " in row and "b: " in row and " -> " in row


def test_the_learning_curve_draws_each_band(tmp_path):
    """The held-out accuracy panel carries one curve per ``eval.by`` band, unless there are too many to read."""
    from sara.metrics import MAX_PLOTTED_BANDS, accuracy_keys, plot_learning_curves

    records = [{"env/cum_rollouts": 0.0, "eval/acc_sample": 0.2, "eval/acc_sample/b": 0.1, "eval/acc_sample/a": 0.3},
               {"env/cum_rollouts": 64.0, "eval/acc_sample": 0.3, "eval/acc_sample/b": 0.2, "eval/acc_sample/a": 0.4,
                "eval/acc_sample/c": 0.5}]
    assert accuracy_keys(records) == ["eval/acc_sample", "eval/acc_greedy", "eval/acc_sample/b", "eval/acc_sample/a",
                                      "eval/acc_sample/c"]
    many = [{f"eval/acc_sample/{i}": 0.5 for i in range(MAX_PLOTTED_BANDS + 1)}]
    assert accuracy_keys(many) == ["eval/acc_sample", "eval/acc_greedy"]
    pytest.importorskip("matplotlib")
    assert plot_learning_curves(records, tmp_path / "curve.png").stat().st_size > 0
