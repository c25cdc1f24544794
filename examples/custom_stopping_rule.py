"""A new stopping rule in a few lines: abandon a prompt after m identical outcomes, whatever the prior says.

Run: python examples/custom_stopping_rule.py
"""

import numpy as np

from sara.allocators import ALLOCATORS, Decision, SequentialAllocator, SequentialConfig, UnitView
from sara.bench.allocation import AllocationBenchConfig, format_table, run_allocation_bench
from sara.testing import check_allocator


class AbandonAfterMConfig(SequentialConfig):
    m: int = 4
    """Abandon after this many identical outcomes."""


@ALLOCATORS.register("abandon_after_m")
class AbandonAfterM(SequentialAllocator):
    """The one hook: decide() sees only undecided, not-yet-mixed units (mixed ones are committed by the template)."""

    Config = AbandonAfterMConfig

    def decide(self, units: UnitView) -> np.ndarray:
        return np.where(units.n >= self.config.m, Decision.ABANDON, Decision.CONTINUE)


if __name__ == "__main__":
    check_allocator(AbandonAfterM(k=8, m=3))  # terminates, budget, accounting, determinism, state round-trip
    print("check_allocator: ok")
    cfg = AllocationBenchConfig(population="u-shaped", k=8, target_groups=512, seeds=3,
                                allocators=["ds", "sara_paper:tau_low=0.45", "abandon_after_m:m=3", "abandon_after_m:m=5"])
    print(format_table(run_allocation_bench(cfg)))
