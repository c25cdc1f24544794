"""What a matrix cell's saving depends on, measured per seed and aggregated with 95% t-intervals, and which machines
its seeds ran on (``sara.experiments.matrix_report`` adds both to every cell and prints them).

Per seed, from the run's result (``RunSummary`` fields, the eval ``curve``, ``phases``): rollouts and generated tokens
per effective group; held-out accuracy gained (last evaluation minus the first) per 100 effective groups; effective
groups to the target accuracy (``curve["effective_groups"]`` at the first crossing, interpolated like the other
measures to target; a seed that never reaches it counts with its run's total, censored); and the generation share
of a step, collection seconds over collection plus learning seconds (``phases``). Pure functions, numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sara.bench.summary import ratio_interval, t_interval
from sara.experiments.curves import crossing_index

__all__ = ["COSTS", "cell_costs", "cost_ratios", "machines", "cost_lines", "COST_NOTES", "format_ci"]

COSTS = ("effective_groups_to_target", "rollouts_per_effective_group", "tokens_per_effective_group",
         "acc_gain_per_100_effective_groups", "generation_share")
"""The per-seed measures of ``cell_costs``, each aggregated as ``{"mean", "half"}``."""

COST_NOTES = (
    "- what the saving depends on (mean ± 95% t-interval over seeds, each seed's own ratio): eff. groups to target: "
    "effective groups trained until the curve first reaches the target (interpolated; ≥ = a seed never reached it and "
    "counts its total), × ref over the reference cell's; rollouts / tokens per eff. group: the run's rollouts and "
    "generated tokens over its effective groups (what the allocator spends per useful group); acc gain / 100 eff. "
    "groups: the last evaluation's held-out accuracy minus the first, per 100 effective groups (what a useful group "
    "teaches); generation share: collection seconds over collection plus learning seconds of the training steps (near "
    "1: generation-bound, where saved rollouts save seconds; near 0: learner-bound).",
    "- seeds by machine: the machines the cell's seeds ran on (`sara.machine.machine_kind`: CPU or GPU, native "
    "bfloat16, cores) and how many seeds each; training seconds compare within one machine kind only.",
)


def _ci(values: Sequence[float]) -> dict[str, float]:
    mean, half = t_interval([float(v) for v in values])
    return {"mean": mean, "half": half}


def _div(a: Any, b: Any) -> float:
    a, b = float(a or 0.0), float(b or 0.0)
    return a / b if b else math.nan


def _groups_to_target(curve: Mapping[str, Sequence[float]], target: float) -> float:
    groups = curve.get("effective_groups")
    if not groups or len(groups) != len(curve["acc"]) or not math.isfinite(target):
        return math.nan
    idx = crossing_index(curve["acc"], target)
    at = len(groups) - 1 if idx is None else idx
    return float(np.interp(at, np.arange(len(groups)), np.asarray(groups, dtype=np.float64)))


def cell_costs(rs: Sequence[Mapping[str, Any]], target: float) -> dict[str, Any]:
    """Every ``COSTS`` measure of a cell's runs ``rs`` (one per seed), mean and 95% t-interval half-width.

    Example: two seeds with 300 rollouts over 10 and 12 effective groups give ``rollouts_per_effective_group``
    ``{"mean": 27.5, "half": t(0.975, 1) x 2.5}``.
    """
    per: dict[str, list[float]] = {key: [] for key in COSTS}
    for r in rs:
        eff = r.get("effective_groups")
        curve = r["curve"]
        per["effective_groups_to_target"].append(_groups_to_target(curve, target))
        per["rollouts_per_effective_group"].append(_div(r.get("rollouts"), eff))
        per["tokens_per_effective_group"].append(_div(r.get("tokens"), eff))
        per["acc_gain_per_100_effective_groups"].append(100 * _div(curve["acc"][-1] - curve["acc"][0], eff))
        ph = r.get("phases") or {}
        per["generation_share"].append(_div(ph.get("collect_s"), float(ph.get("collect_s") or 0)
                                            + float(ph.get("learn_s") or 0)))
    return {key: _ci(values) for key, values in per.items()}


def cost_ratios(costs: dict[str, Any], ref: Mapping[str, Any] | None) -> None:
    """Add ``effective_groups_to_target_ratio`` / ``_half``: the cell's mean over the reference cell's ``ref``."""
    den = (ref or {}).get("effective_groups_to_target", {"mean": math.nan, "half": math.nan})
    r, half = ratio_interval(costs["effective_groups_to_target"], den)
    costs["effective_groups_to_target_ratio"], costs["effective_groups_to_target_ratio_half"] = r, half


def machines(rs: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Seeds per machine kind (a stored run's ``machine_kind``, else its ``machine``; ``not recorded`` without
    either), in order of first appearance."""
    from sara.machine import machine_kind

    out: dict[str, int] = {}
    for r in rs:
        kind = r.get("machine_kind") or (machine_kind(dict(r["machine"])) if r.get("machine") else "not recorded")
        out[str(kind)] = out.get(str(kind), 0) + 1
    return out


def format_ci(v: Mapping[str, float], fmt: str, prefix: str = "") -> str:
    """``mean ± half`` of a ``{"mean", "half"}`` interval in ``fmt`` (``—`` when there is no finite mean)."""
    mean, half = v["mean"], v["half"]
    if mean is None or not math.isfinite(mean):
        return "—"
    text = prefix + format(mean, fmt)
    return text if half is None or not math.isfinite(half) else f"{text} ± {format(half, fmt)}"


def cost_lines(report: Mapping[str, Any], algo: str) -> list[str]:
    """The markdown of ``algo``'s "what the saving depends on" table and, when any run recorded its machine, the
    seeds-by-machine table."""
    cells = [c for c in report["cells"] if c["algo"] == algo and c["aggregate"].get("costs")]
    if not cells:
        return []
    lines = ["", "What the saving depends on (mean ± 95% interval over seeds):", "",
             "| cell | eff. groups to target | × ref | rollouts / eff. group | tokens / eff. group "
             "| acc gain / 100 eff. groups | generation share of a step |", "|---" * 7 + "|"]
    for c in cells:
        a, k = c["aggregate"], c["aggregate"]["costs"]
        cens = "≥ " if a["reached"] < a["n"] else ""
        r, half = k.get("effective_groups_to_target_ratio"), k.get("effective_groups_to_target_ratio_half")
        ratio = "—" if r is None or not math.isfinite(r) else f"{r:.2f}" + (
            f" ± {half:.2f}" if half is not None and math.isfinite(half) else "")
        lines.append(f"| {c['cell']} | {format_ci(k['effective_groups_to_target'], ',.1f', cens)} | {ratio} "
                     f"| {format_ci(k['rollouts_per_effective_group'], '.1f')} "
                     f"| {format_ci(k['tokens_per_effective_group'], ',.0f')} "
                     f"| {format_ci(k['acc_gain_per_100_effective_groups'], '.3f')} "
                     f"| {format_ci(k['generation_share'], '.2f')} |")
    kinds = [(c["cell"], c["aggregate"].get("machines") or {}) for c in cells]
    if any(set(m) - {"not recorded"} for _, m in kinds):
        lines += ["", "Seeds by machine:", "", "| cell | seeds | machines (seeds) |", "|---|---|---|"]
        lines += [f"| {cell} | {sum(m.values())} | " + "; ".join(f"{kind}: {n}" for kind, n in m.items()) + " |"
                  for cell, m in kinds]
    return lines
