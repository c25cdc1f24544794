"""Training metrics: a JSONL log (always), TensorBoard (when installed), a live progress bar, PNG plots.

Every record is a flat dict with namespaced keys (``alloc/...``, ``algo/...``, ``env/...``, ``eval/...``,
``time/...``) plus ``step``. ``time/...`` keys are wall-clock and the only ones that differ between two runs with the
same seed (``deterministic_view`` drops them for comparisons).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MetricsLogger", "OutcomeCounts", "PROGRESS_FIELDS", "ROLLOUTS_PER_EFFECTIVE_GROUP", "accuracy_keys", "read_jsonl",
           "deterministic_view", "metric_value", "plot_learning_curves", "plot_matrix"]


class MetricsLogger:
    """Append per-step metrics to ``out_dir/metrics.jsonl``; mirror them to TensorBoard and a progress bar.

    The log is a ``sara.storage.AppendLog``: never rewritten, one line per record, its length and hash recorded by
    each checkpoint (``manifest``).

    Args:
        out_dir: Output directory (created).
        total_steps: Length of the progress bar.
        progress: Show a progress bar (tqdm when installed, else a line every ``print_every`` steps).
        tensorboard: ``True``/``False``, or ``None`` = use it when ``torch.utils.tensorboard`` imports.
        resume: When resuming, the log's manifest in the checkpoint (``sara.storage.AppendLog``): the log must
            begin with the bytes it names, and what follows them (records logged after the checkpoint by the
            interrupted run, a torn last line) is cut off, so the log reads as one uninterrupted run. None: a new log.
        initial_step: The step the progress bar starts at.
        show: Metrics shown on the progress bar, as ``{label: key}``; a key may be a pair ``(numerator,
            denominator)`` of keys, shown as their ratio (e.g. cumulative rollouts per effective group).
    """

    def __init__(self, out_dir: str | Path, *, total_steps: int = 0, progress: bool = True,
                 tensorboard: bool | None = None, resume: Mapping[str, Any] | None = None, initial_step: int = 0,
                 show: Mapping[str, str | tuple[str, str]] | None = None, print_every: int = 10,
                 live_every: float = 1.0) -> None:
        from sara.storage import AppendLog

        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._log = AppendLog(self.path, None if resume is None else dict(resume))
        self.show = dict(show or {})
        self.print_every = max(1, print_every)
        self.live_every = float(live_every)
        self._live_at = -math.inf
        self._tb = None
        if tensorboard is not False:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tb"))
            except Exception:  # noqa: BLE001 - TensorBoard is optional
                if tensorboard:
                    raise
        self._bar = None
        self._progress = progress
        if progress:
            try:
                from tqdm.auto import tqdm

                self._bar = tqdm(total=total_steps, initial=initial_step, dynamic_ncols=True, leave=True,
                                 file=sys.stderr)
            except ImportError:
                self._bar = None

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Write one record ``{"step": step, **metrics}``."""
        rec = {"step": int(step), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._log.append(json.dumps(rec))
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), step)
        shown = {label: metric_value(metrics, key) for label, key in self.show.items()}
        live = {label: _readable(v) for label, v in shown.items() if v is not None}
        if self._bar is not None:  # the bar counts training steps: the step-0 record (initial evaluation) is not one
            self._bar.set_description_str("", refresh=False)  # the step's live status ends with its record
            self._bar.set_postfix(live, refresh=False)
            self._bar.update(max(0, int(step) - self._bar.n))
            if self._bar.total and self._bar.n >= self._bar.total:
                self._bar.refresh()  # the last step's numbers, whatever tqdm's redraw interval skipped
        elif self._progress and (step % self.print_every == 0):
            print(f"step {step}: " + "  ".join(f"{k}={v}" for k, v in live.items()), file=sys.stderr, flush=True)

    def live(self, text: str, *, force: bool = False) -> None:
        """Show what the run is doing between records (collecting, updating, evaluating): the bar's description with
        tqdm, else a line on stderr; at most once every ``live_every`` seconds unless ``force`` (a new phase);
        nothing when progress is off."""
        now = time.monotonic()
        if not self._progress or (not force and now - self._live_at < self.live_every):
            return
        self._live_at = now
        if self._bar is not None:
            self._bar.set_description_str(text, refresh=True)
        else:
            print(text, file=sys.stderr, flush=True)

    def manifest(self) -> dict[str, Any]:
        """The log's length and sha256 so far (fsynced first), for a checkpoint (``sara.storage.AppendLog``)."""
        return self._log.manifest()

    def close(self) -> None:
        self._log.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def metric_value(record: Mapping[str, Any], key: str | tuple[str, str]) -> float | None:
    """``record[key]``, or for a pair ``(numerator, denominator)`` their ratio; None when a key is missing (or null)
    or the denominator is 0."""
    if isinstance(key, str):
        value = record.get(key)
        return None if value is None else float(value)
    num, den = (record.get(k) for k in key)
    return None if num is None or not den else float(num) / float(den)


ROLLOUTS_PER_EFFECTIVE_GROUP = ("env/cum_rollouts", "env/cum_effective_groups")
"""The run so far's rollouts per effective group (``metric_value``): what allocators differ in (k is the floor; DS
pays k / P(mixed)), where the effective fraction of a filtered batch is 1 for every allocator that filters."""

PROGRESS_FIELDS: dict[str, str | tuple[str, str]] = {
    "acc": "eval/acc_sample", "reward": "env/reward_mean", "rollouts/eff_group": ROLLOUTS_PER_EFFECTIVE_GROUP,
    "rollouts": "env/cum_rollouts"}
"""The training progress bar's fields (``MetricsLogger(show=...)``): the last held-out accuracy, the step's mean
reward, the run's rollouts per effective group so far, its cumulative rollouts."""


def _readable(v: Any) -> str:
    """A progress-bar value: whole numbers with thousands separators (``1,456``), others to 3 significant digits."""
    f = float(v)
    return f"{int(f):,}" if math.isfinite(f) and f.is_integer() else f"{f:.3g}"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (bool, int, str)) or v is None:
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return f if math.isfinite(f) else None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records (JSON objects, one a line) of a JSONL file; a line that is not one (a torn last line from a
    killed writer, bytes that are not UTF-8, JSON nested too deeply or with an integer too long to convert) is
    skipped."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_bytes().splitlines():
        try:
            rec = json.loads(line.decode("utf-8"))
        except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def deterministic_view(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records without wall-clock and machine keys (``time/...``, ``*_seconds``, ``sys/...`` such as the peak resident
    memory), for run-to-run comparisons."""
    return [{k: v for k, v in r.items()
             if not k.startswith(("time/", "sys/")) and not k.endswith("_seconds")} for r in records]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


BAND_PREFIX = "eval/acc_sample/"
"""Held-out accuracy per ``eval.by`` band (``sara.train.evaluate``)."""
MAX_PLOTTED_BANDS = 8
"""More bands than this are left out of the learning curve (they stay in ``metrics.jsonl``)."""


def accuracy_keys(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """The held-out accuracy curves of a learning-curve plot: sampled, greedy, and each ``eval.by`` band in the order
    the records first report them (none when there are more than ``MAX_PLOTTED_BANDS``)."""
    bands = list(dict.fromkeys(k for r in records for k in r if k.startswith(BAND_PREFIX)))
    return ["eval/acc_sample", "eval/acc_greedy", *(bands if len(bands) <= MAX_PLOTTED_BANDS else [])]


def plot_learning_curves(records: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """A 2x2 PNG: held-out accuracy (also per ``eval.by`` band, dashed), training reward, rollouts per effective
    group (cumulative), rollouts per step.

    The x axis is cumulative rollouts (``env/cum_rollouts``), the currency allocation saves.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels: list[tuple[str, list[str | tuple[str, str]]]] = [
        ("held-out accuracy", accuracy_keys(records)),
        ("training reward (committed groups)", ["env/reward_mean"]),
        ("rollouts per effective group (cumulative)", [ROLLOUTS_PER_EFFECTIVE_GROUP]),
        ("rollouts per step", ["alloc/rollouts"]),
    ]
    for ax, (name, keys) in zip(axes.flat, panels):
        for key in keys:
            pts = [(r["env/cum_rollouts"], y) for r in records
                   if (y := metric_value(r, key)) is not None and "env/cum_rollouts" in r]
            if pts:
                xs, ys = zip(*pts)
                name = key if isinstance(key, str) else " / ".join(key)
                band = name.startswith(BAND_PREFIX)
                ax.plot(xs, ys, marker="o" if name.startswith("eval/") else None, ms=2 if band else 3,
                        lw=0.8 if band else 1.5, ls="--" if band else "-",
                        label=f"band {name.removeprefix(BAND_PREFIX)}" if band else name)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("cumulative rollouts")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a panel with no data (a metric the run does not log) has no legend
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def plot_matrix(panels: Mapping[str, Mapping[str, Any]], path: str | Path, *, title: str = "",
                xlabel: str = "cumulative rollouts") -> Path:
    """One panel per algorithm: held-out accuracy vs cumulative rollouts (or ``xlabel``'s quantity), one mean line and
    band per cell.

    Args:
        panels: ``{algo: {"target": accuracy or None, "cells": {cell: {"x", "mean", "lo", "hi"}}}}``: each cell's
            curve on a common grid (``x``), its mean over seeds and a band (``lo`` - ``hi``); ``target`` is drawn as a
            dashed horizontal line.
        path: PNG path.
        title: Figure title.
        xlabel: The x axis' label.
    """
    plt = _pyplot()
    cols = min(len(panels), 4) or 1
    rows = math.ceil(len(panels) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    for ax, (algo, panel) in zip(axes.flat, panels.items()):
        for name, c in panel["cells"].items():
            (line,) = ax.plot(c["x"], c["mean"], lw=1.5, label=name)
            if any(h > lo for lo, h in zip(c["lo"], c["hi"])):
                ax.fill_between(c["x"], c["lo"], c["hi"], color=line.get_color(), alpha=0.18, lw=0)
        target = panel.get("target")
        if target is not None and math.isfinite(target):
            ax.axhline(target, color="0.3", ls="--", lw=1, label=f"target {target:.3f}")
        ax.set_title(algo, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def save_figure(fig: Any, path: str | Path, *, dpi: int = 110) -> Path:
    """Lay out, write atomically (``sara.storage.atomic_write``, creating parent directories) and close a matplotlib
    figure; returns the path."""
    import matplotlib.pyplot as plt

    from sara.storage import atomic_write

    fig.tight_layout()
    path = Path(path)
    try:
        atomic_write(path, lambda fh: fig.savefig(fh, dpi=dpi, format=path.suffix.lstrip(".") or "png"))
    finally:
        plt.close(fig)
    return path


def ds_estimate_applies(sampler: Any) -> bool:
    """Whether a run's 'what DS would have spent' estimate (``OutcomeCounts.p_mixed``) describes DS: only when the
    prompts were drawn uniformly. A sampler that picks the prompts it predicts will mix (``predictive``) makes the
    closed units overstate a uniformly drawn prompt's P(mixed), so the estimate undercounts DS (docs/results.md,
    "What DS would have spent").

    Args:
        sampler: The run's sampler: a spec (``"uniform"``, ``"predictive:decay=0.7"``) or a ``PromptSampler``.
    """
    if isinstance(sampler, str):
        return sampler.strip().split(":", 1)[0].strip() == "uniform"
    from sara.samplers import UniformSampler

    return isinstance(sampler, UniformSampler)


class OutcomeCounts:
    """Every closed unit of a run counted by ``(group, n, s, effective)``: the data behind the 'what DS would have
    spent' estimate (``p_mixed``). ``n`` is capped at ``k`` (a committed group filled to k counts its first k rollouts).

    Args:
        k: The group size.
        labels: Group of each pool index (e.g. a mixture's components, as the allocator splits its prior; None: one
            population). Each group's success rates are fitted on their own.
    """

    def __init__(self, k: int, labels: Any = None) -> None:
        import numpy as np

        self.k = int(k)
        self.labels = None if labels is None else np.asarray(labels, np.int64)
        self.counts: dict[tuple[int, int, int, int], float] = {}

    def record(self, groups: Iterable[Any]) -> None:
        """Count closed units (``sara.types.Group``: committed, abandoned and discarded alike)."""
        from sara.types import Decision

        for g in groups:
            n = min(g.size, self.k)
            s = min(int(round(float(g.rewards[:n].sum()))), n)
            label = 0
            if self.labels is not None and 0 <= g.pool_index < len(self.labels):
                label = int(self.labels[g.pool_index])
            key = (label, n, s, int(g.decision == Decision.COMMIT and g.is_effective()))
            self.counts[key] = self.counts.get(key, 0.0) + 1.0

    def p_mixed(self) -> float:
        """P(a fresh prompt's full size-k group is mixed), unbiased under sequential stopping.

        Units observed to be effective count 1; every other closed unit (abandoned, discarded, saturated) counts its
        posterior-predictive P(mixed) under a mixture over success rates (a grid including 0 and 1, as the allocator's
        own prior) fitted per group by EM to ALL that group's closed units' (n, s). That is valid because the stopping
        rule depends only on observed outcomes. A single Beta cannot hold "never solved" next to "sometimes solved":
        it would credit prompts abandoned after one failure with a sometimes-solved prompt's chance of mixing. How close
        the estimate comes to real DS runs: docs/results.md, "What DS would have spent".
        """
        import numpy as np

        from sara.priors.grid import GRID_POINTS, em_weights, p_mixed_given

        if not self.counts:
            return 0.0
        rows = ((*key, v) for key, v in self.counts.items())  # first-seen order (kept by state_dict)
        g, n, s, eff, c = (np.array(x, dtype=np.float64) for x in zip(*rows))
        grid = np.linspace(0.0, 1.0, GRID_POINTS)
        p = np.ones(len(n))
        for label in np.unique(g):
            at = g == label
            flat = np.full(len(grid), 1.0 / len(grid))
            w = em_weights(grid, np.stack([n[at], s[at]], 1), flat, flat.copy(), counts=c[at])
            p[at] = np.where(eff[at] > 0, 1.0, p_mixed_given(w, grid, n[at], s[at], self.k))
        return float(np.sum(c * p) / np.sum(c))

    def state_dict(self) -> dict[str, Any]:
        return {"k": self.k, "rows": [[*key, v] for key, v in self.counts.items()]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.k = int(state["k"])
        rows = [r if len(r) == 5 else [0, *r] for r in state["rows"]]  # 4-column rows carry no group: group 0
        self.counts = {(int(g), int(n), int(s), int(e)): float(c) for g, n, s, e, c in rows}
