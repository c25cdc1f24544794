"""One aggregation of collection statistics: rollouts and tokens per effective group, and the fractions beside them;
and the one confidence interval the reports give over seeds (``t_interval``), and that of a ratio of two means
(``ratio_interval``).

Every benchmark (``sara bench allocation``, the ``*_vs_*`` comparisons, ``sara matrix``'s table) sums the counts of its
steps / seeds first and divides once (a ratio of sums, not a mean of per-step ratios).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["group_ratios", "ratio_interval", "t_interval"]

_COUNTS = ("rollouts", "tokens", "effective_groups", "committed_groups", "abandoned_groups", "effective_rollouts",
           "wrong_abandons", "prompts_drawn")


def _get(item: Any, name: str) -> float:
    value = item.get(name) if isinstance(item, Mapping) else getattr(item, name, None)
    return float(value or 0)


def group_ratios(items: Iterable[Any]) -> dict[str, float]:
    """Ratios of summed counts over ``items`` (``CollectStats`` or mappings with the same names; missing = 0).

    Returns ``rollouts_per_effective_group``, ``tokens_per_effective_group`` (0 effective groups count as 1),
    ``effective_fraction`` (effective / committed groups), ``waste_fraction`` (rollouts outside effective groups /
    all rollouts), ``wrong_abandon_rate`` (wrong abandons / abandoned groups) and ``abandon_rate`` (abandoned groups /
    prompts drawn); 0.0 where the denominator is 0.
    """
    items = list(items)
    tot = {name: sum(_get(x, name) for x in items) for name in _COUNTS}
    eff = max(tot["effective_groups"], 1.0)
    return {
        "rollouts_per_effective_group": tot["rollouts"] / eff,
        "tokens_per_effective_group": tot["tokens"] / eff,
        "effective_fraction": tot["effective_groups"] / max(tot["committed_groups"], 1.0),
        "waste_fraction": 1.0 - tot["effective_rollouts"] / tot["rollouts"] if tot["rollouts"] else 0.0,
        "wrong_abandon_rate": tot["wrong_abandons"] / tot["abandoned_groups"] if tot["abandoned_groups"] else 0.0,
        "abandon_rate": tot["abandoned_groups"] / max(tot["prompts_drawn"], 1.0),
    }


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of the two-sided Student-t confidence interval of the mean.

    Non-finite values are dropped. With one value the half-width is NaN (no interval); with none both are NaN.

    Example: ``t_interval([1, 2, 3, 4])`` = ``(2.5, 3.1824 * 1.2910 / 2)`` = ``(2.5, 2.0543)``.
    """
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return math.nan, math.nan
    mean = float(v.mean())
    if len(v) < 2:
        return mean, math.nan
    from scipy.stats import t

    half = float(t.ppf(0.5 + confidence / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
    return mean, half


def ratio_interval(num: Mapping[str, float], den: Mapping[str, float]) -> tuple[float, float]:
    """``num["mean"] / den["mean"]`` and the half-width of its interval, propagated from the two means' interval
    half-widths to first order (the delta method for a ratio of independent means:
    ``r * sqrt((h_num / num)^2 + (h_den / den)^2)``); NaN where either side has none.

    Example: ``ratio_interval({"mean": 6, "half": 0.6}, {"mean": 10, "half": 0.8})`` = ``(0.6, 0.6 * sqrt(0.01 +
    0.0064))`` = ``(0.6, 0.0768)``.
    """
    a, b = float(num["mean"]), float(den["mean"])
    if not (math.isfinite(a) and math.isfinite(b)) or b == 0:
        return math.nan, math.nan
    r = a / b
    ha, hb = float(num["half"]), float(den["half"])
    half = abs(r) * math.sqrt((ha / a) ** 2 + (hb / b) ** 2) if a and math.isfinite(ha) and math.isfinite(hb) \
        else math.nan
    return r, half
