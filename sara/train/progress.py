"""What a training run is doing between its step records, so no wait is silent: a step's collection as units close
(rollouts, generated tokens, effective groups of the step's target), its update, and each evaluation (how many
completions, and how long the last one took).

``StepProgress`` is a ``CollectObserver`` of the trainer's ``collect`` call; its lines go to a ``show(text, force)``
callable (the run's ``MetricsLogger.live``, which shows them on the progress bar or stderr).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sara.step import CollectObserver, StepState

__all__ = ["StepProgress"]

Show = Callable[..., Any]
"""``show(text, force=False)``: display ``text`` (``force``: a new phase, shown whatever the rate limit)."""


class StepProgress(CollectObserver):
    """Live status lines of a training run.

    Args:
        show: Where the lines go: ``show(text, force=False)``.
    """

    def __init__(self, show: Show) -> None:
        self.show = show
        self.eval_seconds: float | None = None  # the last evaluation's duration, quoted by the next one
        self._t0 = time.perf_counter()
        self._tokens = 0
        self._effective = 0
        self._seen = (0, 0, 0)  # committed / abandoned / discarded groups already counted this step

    def begin(self, state: StepState) -> None:
        self._t0, self._tokens, self._effective, self._seen = time.perf_counter(), 0, 0, (0, 0, 0)
        self.show(f"step {state.step + 1}: collecting", force=True)

    def closed(self, state: StepState, unit_ids: np.ndarray, decisions: np.ndarray) -> None:
        lists = (state.committed, state.abandoned, state.discarded)
        for seen, groups in zip(self._seen, lists):
            self._tokens += sum(g.num_tokens for g in groups[seen:])
        self._effective += sum(g.is_effective(state.eps) for g in state.committed[self._seen[0]:])
        self._seen = (len(lists[0]), len(lists[1]), len(lists[2]))
        self.show(self._line(state, "collecting"))

    def collected(self, state: StepState) -> None:
        self.show(self._line(state, "collected") + "; updating", force=True)

    def _line(self, state: StepState, verb: str) -> str:
        return (f"step {state.step + 1}: {verb} {state.rollouts:,} rollouts, {self._tokens:,} tokens, "
                f"{self._effective}/{state.target_groups} effective groups ({time.perf_counter() - self._t0:.0f} s)")

    def evaluating(self, completions: int, what: str = "held-out", *, quote_last: bool = True) -> None:
        """An evaluation of ``completions`` completions starts (``quote_last``: say how long the last one took)."""
        last = f"; the last took {self.eval_seconds:.0f} s" if quote_last and self.eval_seconds is not None else ""
        self.show(f"evaluating {completions:,} {what} completions{last}", force=True)
