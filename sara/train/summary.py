"""``RunSummary``: what a training run achieved (``sara train`` prints it; ``sara matrix`` tabulates it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RunSummary", "peak_rss_mb"]


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (``getrusage``; NaN where it is unavailable)."""
    try:
        import resource
        import sys
    except ImportError:  # not a Unix
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


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
    """The last checkpoint written (None if none could be written)."""
    peak_rss_mb: float = float("nan")
    """The process's peak resident memory in MiB when the summary was made (the run's, in a ``sara train`` process)."""

    @property
    def effective_fraction(self) -> float:
        return self.effective_groups / self.committed_groups if self.committed_groups else 0.0
