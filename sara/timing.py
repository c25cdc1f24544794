"""Named wall-clock phase timers, as verl's driver loop times its phases.

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

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Accumulating named timers: ``with timer("env"): ...`` adds the block's seconds to ``timer.seconds["env"]``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def metrics(self, prefix: str = "time/") -> dict[str, float]:
        """``{prefix + name: seconds}`` for every phase timed so far."""
        return {f"{prefix}{k}": v for k, v in self.seconds.items()}
