"""Named wall-clock phase timers, as verl's driver loop times its phases, and optionally each phase's peak memory.

Example:
    >>> timer = PhaseTimer()
    >>> with timer("collect"):
    ...     pass
    >>> sorted(timer.metrics())
    ['time/collect']
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

from sara.memory import reset_peak_rss, window_peak_mb

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Accumulating named timers: ``with timer("env"): ...`` adds the block's seconds to ``timer.seconds["env"]``.

    Args:
        memory: Also keep each phase's peak resident size in ``timer.peaks`` (MiB, the largest over the phase's
            blocks; ``sara.memory``): a phase's window restarts at its start, and a phase timed inside another counts
            toward both. Off Linux the peaks are NaN.
    """

    def __init__(self, memory: bool = False) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.peaks: dict[str, float] = {}
        self.memory = memory
        self._open: list[str] = []  # phases whose memory window is open, outermost first

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.memory:
            self._fold()
            reset_peak_rss()
            self._open.append(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0
            if self.memory:
                self._fold()
                self._open.pop()

    def _fold(self) -> None:
        """Count the window's peak so far toward every open phase."""
        peak = window_peak_mb()
        for name in self._open:
            self.peaks[name] = max(self.peaks.get(name, peak), peak)

    def metrics(self, prefix: str = "time/") -> dict[str, float]:
        """``{prefix + name: seconds}`` for every phase timed so far, and with ``memory``
        ``{"sys/peak_rss_mb/" + name: MiB}``."""
        out = {f"{prefix}{k}": v for k, v in self.seconds.items()}
        return out | {f"sys/peak_rss_mb/{k}": v for k, v in self.peaks.items()}
