"""The report of ``sara bench generation``: ratios to DS and to a reference spec, seeds pooled with confidence
intervals, the markdown table and the JSON file.

Each allocator spec runs once per seed (``GenerationBenchConfig.seeds``). A result's totals (tokens, seconds, rollouts,
effective groups, aborts) are summed over the seeds, so ``tokens_per_second``, ``seconds_per_effective_group`` and
``rollouts_per_effective_group`` are pooled rates, and the ratios (``throughput_ratio``, ``wall_ratio_vs_ds``,
``ratio_vs_ds``, ``ratio_vs_reference``, ``full_ratio_vs_reference``) are ratios of pooled rates. With two seeds or
more, ``ci95`` gives the half-width of the 95% Student-t interval of each ratio over the per-seed ratios (paired: the
same seed's prompts and rollout seeds in both specs), and ``per_seed`` each seed's own figures.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sara.bench.summary import t_interval
from sara.config import parse_spec

__all__ = ["RATIOS", "finish_report", "format_table", "seed_result", "write_json"]

RATIOS = ("throughput_ratio", "wall_ratio_vs_ds", "ratio_vs_ds", "ratio_vs_reference", "full_ratio_vs_reference")
"""The ratios a multi-seed report gives intervals for."""

_SUMS = ("tokens", "rollouts", "effective_groups", "full_groups", "aborted_rollouts", "aborted_tokens", "wall_seconds",
         "generate_seconds", "score_seconds", "full_batch_tokens", "full_batch_seconds", "inflight_seconds",
         "decode_tokens", "decode_steps")
_INTERNAL = ("inflight_seconds", "decode_tokens", "decode_steps")


def seed_result(spec: str, driver: str, acc: dict[str, Any]) -> dict[str, Any]:
    """One spec's figures over one seed (or over the summed totals ``acc`` of several): rates from totals."""
    eff, wall = acc["effective_groups"], acc["wall_seconds"]
    if driver == "sync":  # live rows per decode step of the rounds
        inflight = acc["decode_tokens"] / acc["decode_steps"] if acc["decode_steps"] else 0.0
    else:  # the streaming driver's occupancy, weighted by each step's wall time
        inflight = acc["inflight_seconds"] / wall if wall else 0.0
    tps = acc["tokens"] / wall if wall else 0.0
    full_tps = acc["full_batch_tokens"] / acc["full_batch_seconds"] if acc["full_batch_seconds"] else 0.0
    return {
        "allocator": spec, "driver": driver,
        "tokens_per_second": tps, "full_batch_tokens_per_second": full_tps,
        "throughput_ratio": tps / full_tps if full_tps else None,
        "seconds_per_effective_group": wall / eff if eff else None,
        "wall_ratio_vs_ds": None,
        "rollouts_per_effective_group": acc["rollouts"] / eff if eff else None,
        "ratio_vs_ds": None, "ratio_vs_reference": None,
        "rollouts_per_full_group": acc["rollouts"] / acc["full_groups"] if acc["full_groups"] else None,
        "full_ratio_vs_reference": None,
        "mean_inflight": inflight,
        **{key: acc[key] for key in _SUMS if key not in _INTERNAL},
    }


def _ratios(results: list[dict[str, Any]], reference: str | None) -> None:
    """Fill ``wall_ratio_vs_ds`` / ``ratio_vs_ds`` (against the first ``ds`` entry in rounds, options allowed) and
    ``ratio_vs_reference`` (rollouts per effective group against the entry whose ``allocator[+driver]`` is
    ``reference``), in place."""
    def spec_of(r: dict[str, Any]) -> str:
        return r["allocator"] + ("" if r["driver"] == "sync" else f"+{r['driver']}")

    ds = next((r for r in results if parse_spec(r["allocator"])[0] == "ds" and r["driver"] == "sync"), None)
    ref = next((r for r in results if spec_of(r) == reference), None)
    for r in results:
        if ds is not None and ds["seconds_per_effective_group"] and r["seconds_per_effective_group"] is not None:
            r["wall_ratio_vs_ds"] = r["seconds_per_effective_group"] / ds["seconds_per_effective_group"]
        if ds is not None and ds["rollouts_per_effective_group"] and r["rollouts_per_effective_group"] is not None:
            r["ratio_vs_ds"] = r["rollouts_per_effective_group"] / ds["rollouts_per_effective_group"]
        if ref is not None and ref["rollouts_per_effective_group"] and r["rollouts_per_effective_group"] is not None:
            r["ratio_vs_reference"] = r["rollouts_per_effective_group"] / ref["rollouts_per_effective_group"]
        if ref is not None and ref["rollouts_per_full_group"] and r["rollouts_per_full_group"] is not None:
            r["full_ratio_vs_reference"] = r["rollouts_per_full_group"] / ref["rollouts_per_full_group"]


def finish_report(per_seed: list[list[dict[str, Any]]], seeds: list[int], reference: str | None) -> list[dict[str, Any]]:
    """``results[]`` from each seed's totals (``per_seed[s][i]``: spec ``i``'s ``acc`` at seed ``s``)."""
    rows = [[seed_result(a["spec"], a["driver"], a) for a in accs] for accs in per_seed]
    for row in rows:
        _ratios(row, reference)
    pooled = []
    for i, first in enumerate(per_seed[0]):
        tot = {key: sum(accs[i][key] for accs in per_seed) for key in _SUMS}
        pooled.append(seed_result(first["spec"], first["driver"], tot))
    _ratios(pooled, reference)
    if len(seeds) > 1:
        for i, r in enumerate(pooled):
            r["ci95"] = {}
            for key in RATIOS:
                vals = [row[i][key] for row in rows if row[i][key] is not None]
                half = t_interval(vals)[1] if len(vals) > 1 else math.nan
                r["ci95"][key] = None if math.isnan(half) else half
            keys = (*RATIOS, "tokens_per_second", "seconds_per_effective_group", "rollouts_per_effective_group",
                    "rollouts_per_full_group", "effective_groups", "full_groups", "aborted_rollouts")
            r["per_seed"] = [{"seed": s, **{key: row[i][key] for key in keys}} for s, row in zip(seeds, rows)]
    return pooled


def _fmt(x: Any, spec: str = ".2f", ci: Any = None) -> str:
    if x is None:
        return "—"
    return format(x, spec) + ("" if ci is None else f" ± {format(ci, spec)}")


def format_table(report: dict[str, Any]) -> str:
    """The report as a markdown table (one row per allocator; ``± x``: 95% interval over seeds)."""
    ref = report["config"].get("reference")
    head = ("| allocator | driver | tok/s | full batch tok/s | throughput ratio | s / eff. group | wall vs DS | "
            "rollouts / eff. group | vs DS | " + (f"vs `{ref}` | " if ref else "") +
            "rollouts / full-size eff. group | " + (f"vs `{ref}` | " if ref else "") +
            "mean in flight | aborted | eff. groups (full size) |")
    seeds = report["config"].get("seeds", 1)
    lines = [f"backend {report['backend']}, task {report['task']}" + (f", {seeds} seeds" if seeds > 1 else ""), "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["results"]:
        ci = r.get("ci95", {})
        cells = [f"`{r['allocator']}`", r["driver"], _fmt(r["tokens_per_second"], ".1f"),
                 _fmt(r["full_batch_tokens_per_second"], ".1f"), _fmt(r["throughput_ratio"], ci=ci.get("throughput_ratio")),
                 _fmt(r["seconds_per_effective_group"], ".3f"), _fmt(r["wall_ratio_vs_ds"], ci=ci.get("wall_ratio_vs_ds")),
                 _fmt(r["rollouts_per_effective_group"], ".1f"), _fmt(r["ratio_vs_ds"], ci=ci.get("ratio_vs_ds"))]
        if ref:
            cells.append(_fmt(r["ratio_vs_reference"], ".3f", ci.get("ratio_vs_reference")))
        cells.append(_fmt(r["rollouts_per_full_group"], ".1f"))
        if ref:
            cells.append(_fmt(r["full_ratio_vs_reference"], ".3f", ci.get("full_ratio_vs_reference")))
        cells += [_fmt(r["mean_inflight"], ".1f"), str(r["aborted_rollouts"]),
                  f"{r['effective_groups']} ({r['full_groups']})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    """Write the report as JSON (parent directories created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
