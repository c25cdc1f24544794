"""``RunSummary``: what a training run achieved (``sara train`` prints it; ``sara matrix`` tabulates it), and the
files it wrote."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from sara.memory import peak_rss_mb
from sara.metrics import BAND_PREFIX, OutcomeCounts
from sara.train.dtypes import run_machine
from sara.train.flops import FLOP_PARTS, FlopFloor

if TYPE_CHECKING:
    from sara.train.config import TrainConfig
    from sara.types import CollectResult

__all__ = ["FATES", "PHASES", "STAT_TOTALS", "RunSummary", "SummarizedRun", "cumulative_spend", "note_peak", "summarize",
           "run_files", "step_accounting"]

FATES = ("committed", "abandoned", "discarded", "aborted")
"""Where a generated token ends up: in a committed group (trained), an abandoned unit, a discarded unit (saturated
under DS, surplus, or unfinished at a step's end), or a rollout cancelled while running (streaming)."""
PHASES = ("collect", "advantages", "update", "sync")
"""The timed phases of a training step (``Trainer.train_step``); their sum is the step's training seconds."""
STAT_TOTALS = ("rollouts", "tokens", "committed_tokens", "abandoned_tokens", "discarded_tokens", "aborted_tokens",
               "prompt_tokens", "committed_groups", "effective_groups")
"""The ``CollectStats`` fields a run adds up over its steps (``Trainer.totals``)."""


def note_peak(totals: MutableMapping[str, float], metrics: Mapping[str, float]) -> float:
    """Fold the phase peaks in ``metrics`` (``sys/peak_rss_mb/<phase>``, MiB) into the run's (``totals["peak_rss_mb"]``,
    checkpointed with the totals) and return it; the process's peak while the run has none."""
    peaks = [v for key, v in metrics.items() if key.startswith("sys/peak_rss_mb/") and not math.isnan(v)]
    totals["peak_rss_mb"] = max([totals.get("peak_rss_mb", 0.0), *peaks])
    return totals["peak_rss_mb"] or peak_rss_mb()


def cumulative_spend(totals: Mapping[str, float]) -> dict[str, float]:
    """The run's spending so far as ``metrics.jsonl`` fields: generated tokens (``env/cum_tokens``) and by fate
    (``env/cum_<fate>_tokens``), prompt tokens (``env/cum_prompt_tokens``), trained completion tokens
    (``train/cum_trained_tokens``), training seconds by phase (``time/cum_<phase>``) and, where known, the FLOP
    floor by part (``perf/cum_flop_floor_<part>``, ``sara.train.flops``)."""
    return {"env/cum_tokens": totals["tokens"],
            **{f"env/cum_{fate}_tokens": totals[f"{fate}_tokens"] for fate in FATES},
            "env/cum_prompt_tokens": totals["prompt_tokens"], "train/cum_trained_tokens": totals["trained_tokens"],
            **{f"time/cum_{phase}": totals[f"seconds_{phase}"] for phase in PHASES}, **flop_floor(totals)}


def flop_floor(totals: Mapping[str, float]) -> dict[str, float]:
    """``perf/cum_flop_floor_<part>`` of ``totals``' finite ``flops_<part>`` entries (none for a policy whose floor is
    unknown)."""
    found = {part: totals.get(f"flops_{part}", math.nan) for part in FLOP_PARTS}
    return {f"perf/cum_flop_floor_{part}": v for part, v in found.items() if math.isfinite(v)}


def step_accounting(result: CollectResult, totals: MutableMapping[str, float], outcomes: OutcomeCounts,
                    floor: FlopFloor) -> dict[str, float]:
    """A collection step's ``alloc/...`` accounting and ``env/...`` rewards; adds its counts to the run's ``totals``
    (``STAT_TOTALS``, the generation's FLOP floor) and its closed units to ``outcomes``."""
    st = result.stats
    out: dict[str, float] = st.as_metrics("alloc/")
    out["alloc/effective_fraction"] = st.effective_groups / st.committed_groups if st.committed_groups else 0.0
    all_groups = [*result.groups, *result.abandoned, *result.discarded]
    rewards = np.concatenate([g.rewards for g in all_groups]) if all_groups else np.zeros(0)
    committed = np.concatenate([g.rewards for g in result.groups]) if result.groups else np.zeros(0)
    out["env/reward_mean"] = float(rewards.mean()) if len(rewards) else 0.0
    out["env/reward_committed"] = float(committed.mean()) if len(committed) else 0.0
    out["env/group_size_mean"] = float(np.mean([g.size for g in result.groups])) if result.groups else 0.0
    outcomes.record(all_groups)
    for key in STAT_TOTALS:
        totals[key] += st.__dict__[key]
    floor.add(totals, "collect", floor.generation(r for g in all_groups for r in g.rollouts))
    return out


@dataclass
class RunSummary:
    """What a run achieved (``sara train`` prints it; ``sara matrix`` tabulates it)."""

    name: str
    algo: str
    allocator: str
    steps: int
    acc_before: float
    acc_after: float
    greedy_before: float | None
    greedy_after: float | None
    rollouts: int
    tokens: int
    effective_groups: int
    committed_groups: int
    p_mixed: float
    ds_rollouts_estimate: float
    wall_seconds: float
    out_dir: str
    abandoned_tokens: int = 0
    """Tokens generated for units the allocator abandoned (spent without reaching the batch)."""
    ds_tokens_estimate: float = float("nan")
    """Tokens DS would have generated: ``ds_rollouts_estimate`` x this run's mean tokens per rollout."""
    verifier_errors: int = 0
    """Training rollouts whose verifier raised (scored 0)."""
    verifier_timeouts: int = 0
    """Training rollouts whose verifier ran past the task's time limit (scored 0)."""
    interrupted: str | None = None
    """The signal (``"SIGINT"`` / ``"SIGTERM"``) that stopped the run early, after a final checkpoint; None if it was
    not interrupted."""
    checkpoint: str | None = None
    """The last checkpoint written (None if none was: ``checkpoint_every: 0`` writes one only when a signal stops
    the run, so that it can be resumed)."""
    files: list[str] = field(default_factory=list)
    """Every file the run left in ``out_dir``, relative to it (``run_files``); filled by ``Trainer.train``."""
    peak_rss_mb: float = float("nan")
    """The run's peak resident memory in MiB: the largest of its steps' and evaluations' phase peaks
    (``note_peak``), so runs one after another in one process each report their own; the process's peak where the
    platform reports no phase peaks."""
    tokens_by_fate: dict[str, int] = field(default_factory=dict)
    """Generated tokens by fate (``FATES``): committed + abandoned + discarded == ``tokens``; aborted tokens were
    generated by rollouts cancelled while running and are not in ``tokens``."""
    prompt_tokens: int = 0
    """Prompt (prefill) tokens of the generated rollouts, once per rollout (0 where the backend reports none)."""
    trained_tokens: int = 0
    """Completion tokens in the trained batches (the tokens the loss is taken over; banked groups counted once)."""
    seconds_by_phase: dict[str, float] = field(default_factory=dict)
    """Training seconds by phase (``PHASES``), summing to ``wall_seconds`` less the evaluations' and loggers' time."""
    acc_by_band: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Held-out accuracy per ``eval.by`` label (a mixture's components, or prompt-length bands), before and after:
    ``{label: (before, after)}``; empty when the evaluation reports no labels."""
    flop_floor: dict[str, float] = field(default_factory=dict)
    """The FLOPs the run's work could not avoid, by part (``collect``, ``update``, ``eval``: ``sara.train.flops``);
    empty for a policy whose floor is unknown."""
    machine: dict[str, Any] = field(default_factory=dict)
    """Where the run computed: ``sara.machine.machine_info`` (CPU model, dtype-relevant flags, cores, threads,
    torch, ...), its ``kind`` label and the resolved ``dtypes`` (``sara.train.dtypes.run_machine``)."""

    @property
    def effective_fraction(self) -> float:
        return self.effective_groups / self.committed_groups if self.committed_groups else 0.0


class SummarizedRun(Protocol):
    """What ``summarize`` reads of a ``sara.train.Trainer`` (named by its parts: it imports this module)."""

    @property
    def config(self) -> TrainConfig: ...
    @property
    def evals(self) -> Sequence[Mapping[str, float]]: ...
    @property
    def totals(self) -> Mapping[str, float]: ...
    @property
    def outcomes(self) -> OutcomeCounts: ...
    @property
    def step(self) -> int: ...
    @property
    def wall_seconds(self) -> float: ...
    @property
    def out_dir(self) -> str | os.PathLike[str]: ...
    @property
    def last_checkpoint(self) -> Path | None: ...


def summarize(trainer: SummarizedRun, records: Sequence[Mapping[str, Any]] | None = None) -> RunSummary:
    """The ``RunSummary`` of ``trainer`` (a ``sara.train.Trainer``) so far.

    Args:
        trainer: The trainer, after ``train`` or after ``train_step`` calls by hand (its ``wall_seconds`` counts
            every step either way).
        records: The run's JSONL records; when None, the evaluations the trainer ran (``trainer.evals``).
    """
    evals = [r for r in (records or trainer.evals) if "eval/acc_sample" in r]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    t, cfg = trainer.totals, trainer.config
    p_mixed = trainer.outcomes.p_mixed()
    ds = t["effective_groups"] * cfg.k / p_mixed if p_mixed > 0 else float("nan")
    return RunSummary(
        name=cfg.name, algo=cfg.algo, allocator=cfg.allocator, steps=trainer.step,
        acc_before=float(first.get("eval/acc_sample", float("nan"))),
        acc_after=float(last.get("eval/acc_sample", float("nan"))),
        greedy_before=first.get("eval/acc_greedy"), greedy_after=last.get("eval/acc_greedy"),
        rollouts=int(t["rollouts"]), tokens=int(t["tokens"]), effective_groups=int(t["effective_groups"]),
        committed_groups=int(t["committed_groups"]), p_mixed=p_mixed, ds_rollouts_estimate=ds,
        wall_seconds=trainer.wall_seconds, out_dir=str(trainer.out_dir), abandoned_tokens=int(t["abandoned_tokens"]),
        ds_tokens_estimate=ds * t["tokens"] / t["rollouts"] if t["rollouts"] else float("nan"),
        verifier_errors=int(t["verifier_errors"]), verifier_timeouts=int(t["verifier_timeouts"]),
        tokens_by_fate={fate: int(t[f"{fate}_tokens"]) for fate in FATES}, prompt_tokens=int(t["prompt_tokens"]),
        trained_tokens=int(t["trained_tokens"]),
        seconds_by_phase={phase: float(t[f"seconds_{phase}"]) for phase in PHASES},
        checkpoint=None if trainer.last_checkpoint is None else str(trainer.last_checkpoint),
        peak_rss_mb=t["peak_rss_mb"] or peak_rss_mb(),
        acc_by_band={key.removeprefix(BAND_PREFIX): (float(first[key]), float(last[key])) for key in first
                     if key.startswith(BAND_PREFIX) and key in last},
        flop_floor={key.removeprefix("perf/cum_flop_floor_"): v for key, v in flop_floor(t).items()},
        machine=run_machine(cfg))


def run_files(out_dir: str | Path, *, max_listed: int = 4) -> list[str]:
    """Every file under ``out_dir``, relative to it and sorted, but the run lock (``sara.train.rundir.LOCK_NAME``); a
    sub-directory with more than ``max_listed`` files (TensorBoard's event files, many checkpoints) is one entry
    ``"dir/ (N files)"``."""
    from sara.train.rundir import LOCK_NAME

    root = Path(out_dir)
    if not root.is_dir():
        return []
    out: list[str] = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir():
            files = sorted(p for p in entry.rglob("*") if p.is_file())
            if len(files) > max_listed:
                out.append(f"{entry.name}/ ({len(files)} files)")
            else:
                out += [p.relative_to(root).as_posix() for p in files]
        elif entry.is_file() and entry.name != LOCK_NAME:
            out.append(entry.name)
    return out
