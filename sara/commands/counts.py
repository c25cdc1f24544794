"""Bounds on the counts the command line takes (seeds, runs, steps, workers, pools, ...), checked before anything runs.

A count past its bound is one line naming the command, the flag's field and the range (``sara: error: matrix: field
'seeds': must be a whole number in [1, 1,000] (got 5000)``), never hours of runs or an allocation that fails late.
The bounds are what one machine and one report can hold; configs carry the same ones (``sara.bench`` configs,
``TrainConfig``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sara.config import MAX_SEED, MAX_STEPS, ConfigError

__all__ = ["BOUNDS", "MAX_BATCH", "MAX_GROUP", "MAX_POOL", "MAX_RUNS", "MAX_SEEDS", "MAX_STEPS", "MAX_TOKENS", "MAX_UNITS",
           "MAX_WORKERS", "check_counts"]

MAX_SEEDS = 1000
"""Most seeds a command repeats its runs over (``--seeds``)."""
MAX_RUNS = 10_000
"""Most runs one ``sara matrix`` starts: cells x seeds (each is a training run with its own directory)."""
MAX_WORKERS = 1024
"""Most worker processes or actors (``--workers``)."""
MAX_POOL = 1_000_000
"""Most prompts of a simulated pool (as a task's ``pool_size``)."""
MAX_UNITS = 10_000_000
"""Most open units ``sara bench decisions`` decides on per call (its unit table holds several arrays of this size)."""
MAX_TOKENS = 131_072
"""Most tokens a completion may have (as ``TrainConfig.max_new_tokens``)."""
MAX_GROUP = 1024
"""Most rollouts a group may have (as ``TrainConfig.k``)."""
MAX_BATCH = 65_536
"""Most groups, rows, prompts or slots of one batch (as ``TrainConfig.groups_per_step``)."""

BOUNDS: Mapping[str, tuple[int, int]] = {
    "seeds": (1, MAX_SEEDS), "steps": (1, MAX_STEPS), "workers": (1, MAX_WORKERS), "pool_size": (1, MAX_POOL),
    "units": (1, MAX_UNITS), "rounds": (1, MAX_STEPS), "k": (2, MAX_GROUP), "target": (1, MAX_BATCH),
    "slots": (1, MAX_BATCH), "completions": (1, MAX_POOL), "max_tokens": (1, MAX_TOKENS), "seed": (0, MAX_SEED),
}
"""The range of each count flag, by field name."""


def check_counts(what: str, args: Any, fields: tuple[str, ...]) -> None:
    """Check the count flags ``fields`` of ``args`` (argparse) against ``BOUNDS``; None (not given) passes.

    Raises:
        ConfigError: naming ``what``, the field, its range and the value given.
    """
    for field in fields:
        value = getattr(args, field)
        low, high = BOUNDS[field]
        if value is not None and not low <= value <= high:
            raise ConfigError(f"{what}: field '{field}': must be a whole number in [{low:,}, {high:,}] (got {value})")
