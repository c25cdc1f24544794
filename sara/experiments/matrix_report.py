"""What ``sara matrix`` reports: per-seed measurements, their means and confidence intervals, the table and the plot.

``analyze`` turns the runs (one per cell x seed, each with its eval curve) into the report (``matrix.json``);
``format_report`` writes the markdown (``matrix.md``); ``write_outputs`` writes all three files. Nothing here trains,
so every function runs on synthetic results.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sara.bench.summary import group_ratios, ratio_interval, t_interval
from sara.experiments.curves import (
    BUDGET_FRACTIONS,
    aggregate_measures,
    band,
    eval_standard_errors,
    seed_measures,
)
from sara.experiments.saving import COST_NOTES, cell_costs, cost_lines, cost_ratios, format_ci, machines
from sara.storage import atomic_write

__all__ = ["MEASURES", "analyze", "format_report", "write_outputs", "plot_report"]

_RAW = ("seed", "name", "algo", "allocator", "steps", "acc_before", "acc_after", "rollouts", "tokens",
        "effective_groups", "committed_groups", "wall_seconds", "out_dir", "curve", "phases", "acc_by_band",
        "tokens_by_fate", "prompt_tokens", "trained_tokens", "seconds_by_phase", "machine_kind", "config_hash",
        "sara_version")
MEASURES = ("rollouts", "tokens", "wall_s")
"""What a cell spends to the target, each compared with the reference cell: rollouts, generated tokens, training
seconds."""


def analyze(runs: Sequence[tuple[Any, Mapping[str, Any]]], *, budget: float, reference: str = "ds",
            target_acc: float | None = None, eval_prompts: int = 0, eval_samples: int = 0,
            grid_points: int = 41) -> dict[str, Any]:
    """Measure every run and aggregate each cell over its seeds.

    Args:
        runs: ``(cell, result)`` pairs; ``cell`` has ``algo``, ``allocator``, ``sampler``, ``spec``, ``name``
            (``sara.experiments.cells.Cell``); ``result`` has ``seed``, the ``RunSummary`` fields and ``curve``
            (columnar: ``rollouts``, ``tokens``, ``wall_s``, ``acc`` at each evaluation).
        budget: The shared rollout budget.
        reference: Allocator spec of the reference cell of each algorithm.
        target_acc: Fixed target accuracy (default: the reference cell's final accuracy, mean over its seeds).
        eval_prompts: Held-out prompts per evaluation (for the standard error).
        eval_samples: Sampled completions per prompt per evaluation.
        grid_points: Points of the common rollout grid of the plot's mean curves and bands.

    Returns:
        ``{"budget", "seeds", "reference", "target_acc", "eval", "fractions", "algos": {algo: {...}},
        "cells": [{"algo", "cell", "allocator", "sampler", "name", "is_reference", "runs", "aggregate", "band"}]}``.
    """
    grouped: dict[tuple[str, str], tuple[Any, list[Mapping[str, Any]]]] = {}
    for cell, res in runs:
        grouped.setdefault((cell.algo, cell.name), (cell, []))[1].append(res)
    algos: dict[str, dict[str, Any]] = {}
    for algo in dict.fromkeys(a for a, _ in grouped):
        ref = next((rs for (a, _), (c, rs) in grouped.items() if a == algo and c.spec == reference), None)
        if target_acc is not None:
            target, source = float(target_acc), "fixed by --target-acc"
        elif ref is not None:
            target = float(np.mean([r["curve"]["acc"][-1] for r in ref]))
            source = f"{reference}'s final held-out accuracy (mean of {len(ref)} seed(s))"
        else:
            target, source = math.nan, f"no {reference} cell"
        start = [r["curve"]["acc"][0] for (a, _), (_, rs) in grouped.items() if a == algo for r in rs]
        se = eval_standard_errors(target, eval_prompts, eval_samples) if eval_prompts and eval_samples and \
            math.isfinite(target) else (math.nan, math.nan)
        algos[algo] = {"target": target, "target_source": source, "reference": reference if ref else None,
                       "start_acc": float(np.mean(start)) if start else math.nan,
                       "eval_se": {"independent": se[0], "prompt_clustered_bound": se[1]}}
    grid = np.linspace(0.0, float(budget), grid_points)
    longest = {a: max((r["curve"]["wall_s"][-1] for (b, _), (_, rs) in grouped.items() if b == a for r in rs),
                      default=0.0) for a in algos}
    most_tokens = {a: max((r["curve"]["tokens"][-1] for (b, _), (_, rs) in grouped.items() if b == a for r in rs),
                          default=0.0) for a in algos}
    cells: list[dict[str, Any]] = []
    for (algo, _), (cell, rs) in grouped.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        target = algos[algo]["target"]
        measured = [seed_measures(r["curve"], target=target, budget=budget) for r in rs]
        agg = aggregate_measures(measured)
        ratios = group_ratios(rs)
        agg["effective_fraction"] = ratios["effective_fraction"]
        agg["rollouts_per_effective_group"] = ratios["rollouts_per_effective_group"]
        mean, half = t_interval([float(r["steps"]) for r in rs if "steps" in r])
        agg["steps"] = {"mean": mean, "half": half}  # training steps in the budget: what saved rollouts buy
        per_group = [r["curve"]["wall_s"][-1] / r["effective_groups"] if r.get("effective_groups") else math.nan
                     for r in rs]  # training seconds (no evaluation) per effective group, per seed
        mean, half = t_interval(per_group)
        agg["wall_s_per_effective_group"] = {"mean": mean, "half": half}
        agg["phases"] = _phases(rs)
        agg["tokens"] = _tokens(rs)
        agg["final_acc_by_band"] = _by_band(rs, 1)
        agg["costs"], agg["machines"] = cell_costs(rs, target), machines(rs)  # sara.experiments.saving
        cells.append({"algo": algo, "cell": cell.spec, "allocator": cell.allocator, "sampler": cell.sampler,
                      "name": cell.name, "is_reference": cell.spec == reference,
                      "runs": [{**{k: r[k] for k in _RAW if k in r}, "measures": m} for r, m in zip(rs, measured)],
                      "aggregate": agg,
                      "band": band([(r["curve"]["rollouts"], r["curve"]["acc"]) for r in rs], grid),
                      "band_seconds": band([(r["curve"]["wall_s"], r["curve"]["acc"]) for r in rs],
                                           np.linspace(0.0, longest[algo], grid_points)),
                      "band_tokens": band([(r["curve"]["tokens"], r["curve"]["acc"]) for r in rs],
                                          np.linspace(0.0, most_tokens[algo], grid_points))})
    for c in cells:
        ref_cell = next((d for d in cells if d["algo"] == c["algo"] and d["is_reference"]), None)
        for key in MEASURES:
            num = c["aggregate"][f"{key}_to_target"]
            den = ref_cell["aggregate"][f"{key}_to_target"] if ref_cell else {"mean": math.nan, "half": math.nan}
            c["aggregate"][f"{key}_ratio"], c["aggregate"][f"{key}_ratio_half"] = ratio_interval(num, den)
        cost_ratios(c["aggregate"]["costs"], ref_cell["aggregate"]["costs"] if ref_cell else None)
        ph, ref_ph = c["aggregate"]["phases"], (ref_cell or {}).get("aggregate", {}).get("phases")
        if ph is not None:
            ref_rate = ref_ph["collect_s_per_token"] if ref_ph else math.nan
            ph["collect_s_per_token_ratio"] = ph["collect_s_per_token"] / ref_rate if ref_rate else math.nan
    for algo, info in algos.items():
        info["start_acc_by_band"] = _by_band([r for (a, _), (_, rs) in grouped.items() if a == algo for r in rs], 0)
    seeds = sorted({int(r["seed"]) for _, r in runs})
    return {"budget": budget, "seeds": seeds, "reference": reference, "target_acc": target_acc,
            "eval": {"prompts": eval_prompts, "samples": eval_samples}, "fractions": list(BUDGET_FRACTIONS),
            "algos": algos, "cells": cells}


def _tokens(rs: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """Where a cell's tokens go, pooled over its seeds, per effective group: generated tokens by fate
    (``sara.train.summary.FATES``), prompt (prefill) tokens and trained completion tokens; None when a run has no
    ``tokens_by_fate``."""
    from sara.train.summary import FATES

    if not rs or any(not r.get("tokens_by_fate") for r in rs):
        return None
    eff = sum(float(r.get("effective_groups") or 0) for r in rs)
    div = lambda a: a / eff if eff else math.nan  # noqa: E731
    out = {f"{fate}_per_effective_group": div(sum(float(r["tokens_by_fate"].get(fate, 0)) for r in rs))
           for fate in FATES}
    gen = sum(float(r.get("tokens") or 0) for r in rs)
    out["generated_per_effective_group"] = div(gen)
    out["prompt_per_effective_group"] = div(sum(float(r.get("prompt_tokens") or 0) for r in rs))
    out["trained_per_effective_group"] = div(sum(float(r.get("trained_tokens") or 0) for r in rs))
    rollouts = sum(float(r.get("rollouts") or 0) for r in rs)
    out["generated_per_rollout"] = gen / rollouts if rollouts else math.nan
    return out


def _phases(rs: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    """Where a cell's training seconds go, pooled over its seeds (all seeds' sums over all seeds' counts); None when a
    run has no ``phases`` (``sara.experiments.matrix.PHASE_KEYS``)."""
    if not rs or any("phases" not in r for r in rs):
        return None
    tot = {k: sum(float(r["phases"][k]) for r in rs) for k in rs[0]["phases"]}
    eff = sum(float(r.get("effective_groups") or 0) for r in rs)
    rollouts = sum(float(r.get("rollouts") or 0) for r in rs)
    div = lambda a, b: a / b if b else math.nan  # noqa: E731
    return {"collect_s_per_effective_group": div(tot["collect_s"], eff),
            "learn_s_per_effective_group": div(tot["learn_s"], eff),
            "collect_s_per_rollout": div(tot["collect_s"], rollouts),
            "collect_s_per_token": div(tot["collect_s"], sum(float(r.get("tokens") or 0) for r in rs)),
            "rollouts_per_round": div(rollouts, tot["rounds"]), "rounds_per_step": div(tot["rounds"], tot["steps"]),
            "banked_per_step": div(tot["banked_groups"], tot["steps"]),
            "group_reward_var": div(tot["reward_var_x_groups"], tot["trained_groups"])}


def _by_band(rs: Sequence[Mapping[str, Any]], at: int) -> dict[str, dict[str, float]] | None:
    """Held-out accuracy per ``eval.by`` band over runs ``rs`` (``at``: 0 before training, 1 after), mean and 95%
    t-interval half-width; None unless every run reports the same bands."""
    bands = [r.get("acc_by_band") or {} for r in rs]
    if not bands or not bands[0] or any(b.keys() != bands[0].keys() for b in bands):
        return None
    out = {}
    for label in bands[0]:
        mean, half = t_interval([float(b[label][at]) for b in bands])
        out[label] = {"mean": mean, "half": half}
    return out


def _ratio(ratio: float | None, censored: bool, half: float | None = None) -> str:
    if ratio is None or not math.isfinite(ratio):
        return "—"
    text = f"{ratio:.2f}" + ("" if half is None or not math.isfinite(half) else f" ± {half:.2f}")
    return text + ("*" if censored else "")


def format_report(report: Mapping[str, Any]) -> str:
    """The markdown of ``matrix.md``: one table per algorithm, then how each column is computed."""
    fr = [f for f in report["fractions"] if f < 1.0]
    seeds = report["seeds"]
    lines = []
    if report.get("command"):
        wall = report.get("wall_seconds")
        lines += [f"`{report['command']}`" + (f" ({wall:.0f} s wall)" if wall is not None else ""), ""]
    lines += [f"Budget {report['budget']:,.0f} rollouts per run; {len(seeds)} seed(s) per cell "
              f"({', '.join(map(str, seeds))}); values are the mean ± the 95% t-interval half-width over seeds "
              "(one seed: the value alone)."]
    store = report.get("store")
    if store:
        lines += ["", f"From the results store `{store['path']}`: " + "; ".join(
            f"{v['runs']} run(s) of config {v['config_hash']}, sara {v['sara_version']}" for v in store["variants"])
            + (" (cells of another config or version are labelled and never pooled)."
               if len(store["variants"]) > 1 else ".")]
    ev = report["eval"]
    ref_censored = {algo: any(c["is_reference"] and c["aggregate"]["reached"] < c["aggregate"]["n"]
                              for c in report["cells"] if c["algo"] == algo) for algo in report["algos"]}
    for algo, info in report["algos"].items():
        se = info["eval_se"]
        lines += ["", f"### {algo}", "",
                  f"Target accuracy {info['target']:.3f} ({info['target_source']}); every cell starts at "
                  f"{info['start_acc']:.3f} (mean over runs)."]
        if ev["prompts"] and math.isfinite(se["independent"]):
            lines.append(f"One evaluation ({ev['prompts']} prompts x {ev['samples']} samples) has a standard error "
                         f"of {se['independent']:.4f} at p = {info['target']:.3f} counting each completion as an "
                         f"independent draw, sqrt(p(1-p)/(prompts x samples)); samples of one prompt are correlated, "
                         f"so the true SE lies between that and {se['prompt_clustered_bound']:.4f} "
                         "(sqrt(p(1-p)/prompts)).")
        lines += ["", "| cell | final acc | " + " | ".join(f"acc @{100 * f:.0f}%" for f in fr) +
                  " | AUC | reached | rollouts to target | × ref | tokens to target | × ref | train s to target | × ref "
                  "| train s / eff. group | rollouts / eff. group | steps | eff. frac |", "|---" * (14 + len(fr)) + "|"]
        for c in (c for c in report["cells"] if c["algo"] == algo):
            a = c["aggregate"]
            cens = "≥ " if a["reached"] < a["n"] else ""
            censored = a["reached"] < a["n"] or ref_censored[algo]
            name = f"**{c['cell']}** (ref)" if c["is_reference"] else c["cell"]
            spent = [x for key, fmt in zip(MEASURES, (",.0f", ",.0f", ".1f"))
                     for x in (format_ci(a[f"{key}_to_target"], fmt, cens),
                               _ratio(a[f"{key}_ratio"], censored, a.get(f"{key}_ratio_half")))]
            lines.append(" | ".join([
                f"| {name}", format_ci(a["final_acc"], ".3f"), *(format_ci(a["acc_at"][str(f)], ".3f") for f in fr),
                format_ci(a["auc"], ".3f"), f"{a['reached']}/{a['n']}", *spent,
                format_ci(a["wall_s_per_effective_group"], "#.3g"),
                f"{a['rollouts_per_effective_group']:.1f}", format_ci(a["steps"], ".1f"), f"{a['effective_fraction']:.2f} |"]))
        lines += cost_lines(report, algo)
        rows = [(c["cell"], c["aggregate"].get("phases")) for c in report["cells"] if c["algo"] == algo]
        if all(ph is not None for _, ph in rows):
            lines += ["", "Where the training seconds go (all seeds pooled):", "",
                      "| cell | collect s / eff. group | learn s / eff. group | collect s / rollout "
                      "| collect s / 1k tokens | × ref "
                      "| rollouts per round | rounds per step | banked groups per step | batch reward var |",
                      "|---" * 10 + "|"]
            lines += [f"| {cell} | {ph['collect_s_per_effective_group']:.3f} "
                      f"| {ph['learn_s_per_effective_group']:.3f} | {ph['collect_s_per_rollout']:.4f} "
                      f"| {1000 * ph['collect_s_per_token']:.2f} | {_ratio(ph.get('collect_s_per_token_ratio'), False)} "
                      f"| {ph['rollouts_per_round']:.1f} | {ph['rounds_per_step']:.2f} "
                      f"| {ph['banked_per_step']:.2f} | {ph['group_reward_var']:.3f} |" for cell, ph in rows]
        toks = [(c["cell"], c["aggregate"].get("tokens")) for c in report["cells"] if c["algo"] == algo]
        if all(t is not None for _, t in toks):
            lines += ["", "Where the tokens go, per effective group (all seeds pooled):", "",
                      "| cell | generated | committed | abandoned | discarded | aborted (not in generated) "
                      "| prompt (prefill) | trained | generated / rollout |", "|---" * 9 + "|"]
            lines += [f"| {cell} | {t['generated_per_effective_group']:,.0f} | {t['committed_per_effective_group']:,.0f} "
                      f"| {t['abandoned_per_effective_group']:,.0f} | {t['discarded_per_effective_group']:,.0f} "
                      f"| {t['aborted_per_effective_group']:,.0f} | {t['prompt_per_effective_group']:,.0f} "
                      f"| {t['trained_per_effective_group']:,.0f} | {t['generated_per_rollout']:.1f} |"
                      for cell, t in toks]
        start = info.get("start_acc_by_band")
        bands = [(c["cell"], c["aggregate"].get("final_acc_by_band")) for c in report["cells"] if c["algo"] == algo]
        if start and all(b is not None and b.keys() == start.keys() for _, b in bands):
            lines += ["", "Final held-out accuracy per band (`eval.by`: a mixture's components, else prompt-length "
                      "bands); start: before training, all runs:", "",
                      "| cell | " + " | ".join(start) + " |", "|---" * (len(start) + 1) + "|",
                      "| start | " + " | ".join(format_ci(v, ".3f") for v in start.values()) + " |"]
            lines += [f"| {cell} | " + " | ".join(format_ci(b[k], ".3f") for k in start) + " |" for cell, b in bands]
    lines += ["", "How the columns are computed:",
              "- acc @X%: held-out accuracy (sampled at the training temperature) read off the run's accuracy vs "
              "cumulative rollouts curve at X% of the budget, linear between evaluations; final acc: the last "
              "evaluation; AUC: the area under that curve over [0, budget] divided by the budget.",
              "- rollouts / tokens / train s to target: where the curve first reaches the target, interpolated "
              "linearly between the two evaluations around the crossing. A seed that never reaches it (see "
              "`reached`) counts with its whole run's totals (censored), so the mean is a lower bound, marked ≥. "
              "Each × ref: the cell's mean to target over the reference cell's (same target, same censoring; * = either "
              "side has a censored seed, so the ratio is of lower bounds and bounds nothing), ± the 95% interval "
              "propagated from the two means' intervals (first order). tokens: generated completion tokens (prompt "
              "tokens apart, in the tokens table).",
              "- train s: training wall-clock (collect, advantages, update, sync), without evaluation; runs share "
              "the machine's cores, so seconds compare within one matrix only. train s / eff. group: a run's "
              "training seconds over its effective groups (the streaming driver, `--driver stream`, shows up "
              "here). eff. frac: effective / committed groups over all seeds.",
              "- rollouts / eff. group: all seeds' rollouts over their effective groups (what the allocator saves); "
              "steps: training steps (= weight updates) the budget bought; with `surplus=bank` (the default) every "
              "batch is `groups_per_step` groups, so saved rollouts show up as more steps.",
              "- where the seconds go: collect (the driver's rounds: generation, scoring, allocation) and learn "
              "(advantages, update, weight sync) seconds over effective groups, rollouts or 1,000 generated tokens "
              "(× ref: over the reference cell's, the engine's cost of a token under each allocator); rounds: the driver's "
              "synchronous rounds (streaming: none); banked groups: left in the surplus bank after a step; batch "
              "reward var: the trained groups' mean within-group reward variance (`train/group_reward_var`, p(1 - p) "
              "of a group's own success rate for 0/1 rewards).", *COST_NOTES]
    return "\n".join(lines) + "\n"


_AXES = {"rollouts": ("band", "cumulative rollouts", "held-out accuracy vs rollouts, budget {budget:,.0f} per run"),
         "seconds": ("band_seconds", "training seconds (no evaluation)",
                     "held-out accuracy vs training seconds (no eval.)"),
         "tokens": ("band_tokens", "cumulative generated tokens", "held-out accuracy vs generated tokens")}


def plot_report(report: Mapping[str, Any], path: str | Path, *, x: str = "rollouts") -> Path:
    """Per algorithm, each cell's mean held-out accuracy over seeds with a min-max band and the target accuracy as a
    horizontal line, against ``x``: ``"rollouts"`` (``matrix.png``), ``"seconds"`` (training seconds,
    ``matrix_seconds.png``) or ``"tokens"`` (generated tokens, ``matrix_tokens.png``); a run that ended earlier stays
    at its final accuracy. Needs matplotlib."""
    from sara.metrics import plot_matrix

    key, xlabel, head = _AXES[x]
    panels = {algo: {"target": info["target"],
                     "cells": {c["cell"]: c[key] for c in report["cells"] if c["algo"] == algo and key in c}}
              for algo, info in report["algos"].items()}
    n = len(report["seeds"])
    return plot_matrix(panels, path, xlabel=xlabel,
                       title=f"{head.format(budget=report['budget'])}\nmean of {n} seed(s), band = min-max over seeds")


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, Mapping):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_outputs(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``matrix.json`` (NaN as null), ``matrix.md`` and, when matplotlib is installed, ``matrix.png``,
    ``matrix_seconds.png`` and ``matrix_tokens.png``, each atomically (``sara.storage.atomic_write``: a crash leaves
    the previous file, a link at the path is replaced, never followed)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "matrix.json", "md": out / "matrix.md"}
    for key, text in (("json", json.dumps(_finite(report), indent=1, default=float)), ("md", format_report(report))):
        atomic_write(paths[key], lambda fh, text=text: fh.write(text.encode("utf-8")))
    try:
        paths["png"] = plot_report(report, out / "matrix.png")
        paths["png_seconds"] = plot_report(report, out / "matrix_seconds.png", x="seconds")
        paths["png_tokens"] = plot_report(report, out / "matrix_tokens.png", x="tokens")
    except ImportError:  # matplotlib is optional
        pass
    return paths
