"""Small datasets bundled with sara, written for this project (no downloaded data).

``math_small.jsonl`` (MATH-style problems with ``\\boxed`` solutions), ``aime_small.jsonl`` (integer answers) and
``gsm8k_small.jsonl`` (``#### <number>`` answers) feed the task tests and the quickstart.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["data_path"]


def data_path(name: str) -> Path:
    """Path of a bundled data file, e.g. ``data_path("math_small.jsonl")``."""
    path = Path(__file__).with_name(name)
    if not path.is_file():
        known = sorted(p.name for p in Path(__file__).parent.glob("*.jsonl"))
        raise FileNotFoundError(f"no bundled data file {name!r}; known: {', '.join(known)}")
    return path
