"""Statistics of accuracy-vs-rollouts curves: the measurements of ``sara matrix`` (pure functions, numpy only).

A curve is one training run's held-out evaluations, columnar: ``{"rollouts": [...], "tokens": [...], "wall_s": [...],
"acc": [...]}`` at each evaluation (cumulative rollouts / tokens / training seconds, and the held-out accuracy). Between
evaluations a curve is read as the straight line through the two points (linear interpolation); beyond its last point
it stays flat (the run has stopped).

Example:
    >>> first_reach([0, 100, 200], [0.5, 0.6, 0.8], 0.7)
    150.0
    >>> normalized_auc([0, 100], [0.2, 0.6], 100)
    0.4
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sara.bench.summary import t_interval

__all__ = ["crossing_index", "first_reach", "value_at", "normalized_auc", "seed_measures",
           "aggregate_measures", "band", "eval_standard_errors", "BUDGET_FRACTIONS"]

BUDGET_FRACTIONS: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
"""Where held-out accuracy is read off each curve, as fractions of the shared rollout budget."""

_TOL = 1e-12  # a curve that ends exactly at the target (the reference's own mean) reaches it despite rounding


def crossing_index(ys: Sequence[float], target: float) -> float | None:
    """The fractional index where the piecewise-linear curve through ``ys`` first reaches ``target`` (None: never).

    ``i + f`` means a fraction ``f`` of the way from point ``i`` to point ``i + 1``; 0.0 when the first point is
    already at or above the target.
    """
    y = np.asarray(ys, dtype=np.float64)
    hit = np.flatnonzero(y >= target - _TOL)
    if len(hit) == 0:
        return None
    i = int(hit[0])
    if i == 0:
        return 0.0
    y0, y1 = y[i - 1], y[i]  # y0 < target <= y1
    return (i - 1) + float(np.clip((target - y0) / (y1 - y0), 0.0, 1.0))


def _at_index(xs: Sequence[float], index: float) -> float:
    x = np.asarray(xs, dtype=np.float64)
    return float(np.interp(index, np.arange(len(x)), x))


def first_reach(xs: Sequence[float], ys: Sequence[float], target: float) -> float | None:
    """``x`` (e.g. cumulative rollouts) where the curve ``(xs, ys)`` first reaches ``target``, interpolated linearly
    between the two evaluations around the crossing; None when it never does."""
    idx = crossing_index(ys, target)
    return None if idx is None else _at_index(xs, idx)


def value_at(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """The curve's value at ``x``: linear between points, flat before the first and after the last."""
    return float(np.interp(x, np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)))


def normalized_auc(xs: Sequence[float], ys: Sequence[float], budget: float) -> float:
    """Area under the curve over ``[0, budget]`` divided by ``budget`` (the mean accuracy over the budget).

    The curve is linear between points and flat outside them (a run that stopped early keeps its last accuracy).
    """
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    grid = np.unique(np.concatenate([[0.0, float(budget)], x[(x > 0) & (x < budget)]]))
    v = np.interp(grid, x, y)
    return float(np.sum((v[1:] + v[:-1]) / 2 * np.diff(grid)) / budget)


def seed_measures(curve: Mapping[str, Sequence[float]], *, target: float, budget: float,
                  fractions: Sequence[float] = BUDGET_FRACTIONS) -> dict[str, Any]:
    """The measurements of one run (one seed of one cell).

    Returns:
        ``final_acc`` (last evaluation), ``auc`` (``normalized_auc``), ``acc_at`` (``{fraction: accuracy at fraction x
        budget}``), ``reached`` (whether the curve reaches ``target``), and ``rollouts_to_target``,
        ``tokens_to_target``, ``wall_s_to_target``: where it first reaches it (interpolated), or, when it never
        does, the run's totals (censored: the true value is larger).
    """
    rollouts, acc = curve["rollouts"], curve["acc"]
    idx = crossing_index(acc, target)
    last = len(acc) - 1
    out: dict[str, Any] = {
        "final_acc": float(acc[-1]),
        "auc": normalized_auc(rollouts, acc, budget),
        "acc_at": {str(f): value_at(rollouts, acc, f * budget) for f in fractions},
        "reached": idx is not None,
    }
    for key in ("rollouts", "tokens", "wall_s"):
        out[f"{key}_to_target"] = _at_index(curve[key], last if idx is None else idx)
    return out


def aggregate_measures(measures: Sequence[Mapping[str, Any]], confidence: float = 0.95) -> dict[str, Any]:
    """Mean and t-interval half-width over seeds of every ``seed_measures`` entry, plus ``reached`` = seeds that
    reached the target, ``n`` = seeds. Each value is ``{"mean": m, "half": h}`` (``half`` NaN with one seed)."""
    out: dict[str, Any] = {"n": len(measures), "reached": int(sum(bool(m["reached"]) for m in measures))}
    for key in ("final_acc", "auc", "rollouts_to_target", "tokens_to_target", "wall_s_to_target"):
        mean, half = t_interval([m[key] for m in measures], confidence)
        out[key] = {"mean": mean, "half": half}
    fractions = list(measures[0]["acc_at"]) if measures else []
    out["acc_at"] = {}
    for f in fractions:
        mean, half = t_interval([m["acc_at"][f] for m in measures], confidence)
        out["acc_at"][f] = {"mean": mean, "half": half}
    return out


def band(curves: Sequence[tuple[Sequence[float], Sequence[float]]], grid: Sequence[float]) -> dict[str, list[float]]:
    """Seeds' curves on a common ``grid``: ``{"x": grid, "mean", "lo", "hi"}`` (mean, min and max over seeds)."""
    g = np.asarray(grid, dtype=np.float64)
    ys = np.stack([np.interp(g, np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))
                   for x, y in curves])
    return {"x": g.tolist(), "mean": ys.mean(0).tolist(), "lo": ys.min(0).tolist(), "hi": ys.max(0).tolist()}


def eval_standard_errors(p: float, prompts: int, samples: int) -> tuple[float, float]:
    """Standard errors of a held-out accuracy ``p`` measured on ``prompts`` x ``samples`` completions.

    Returns ``(bernoulli, prompt_level_bound)``: ``sqrt(p(1-p) / (prompts * samples))`` treats every completion as an
    independent draw (it ignores that samples of one prompt are correlated, so it is a lower bound), and
    ``sqrt(p(1-p) / prompts)`` is the largest the prompt-clustered SE can be (a per-prompt mean in [0, 1] with mean p
    has variance at most p(1-p)). The true SE lies between the two.
    """
    q = float(p) * (1.0 - float(p))
    return math.sqrt(q / (prompts * samples)), math.sqrt(q / prompts)
