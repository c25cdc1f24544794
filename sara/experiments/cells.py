"""The cells of a training matrix: ``algo x ALLOCATOR[@SAMPLER]`` (``Cell``), parsed from ``sara matrix``'s
``--algos`` / ``--allocators`` lists (``parse_specs``, ``parse_cells``); shared by the matrix runner
(``sara.experiments.matrix``) and the result store (``sara.experiments.store``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from sara.config import ConfigError, parse_spec
from sara.specs import parse_allocation

__all__ = ["Cell", "parse_specs", "parse_cells"]


@dataclass(frozen=True)
class Cell:
    """One matrix cell: an algorithm spec, an allocator spec, and the cell's own sampler (None = the base config's).

    ``spec`` is the allocator as written (``ALLOCATOR[@SAMPLER]``); ``name`` is filesystem-safe and unique in a run.
    """

    algo: str
    allocator: str
    sampler: str | None
    spec: str
    name: str


def parse_specs(text: str, field: str, *, example: str) -> list[str]:
    """Split a ``;``-separated list of specs (each may carry ``name:key=value,...`` options).

    The old comma-separated form is accepted when it cannot be misread: no ``;`` and no ``:`` (``"ds,sara"``), or one
    spec whose options are separated by commas (``"sara:prior=history,decay=0.95"``).

    Raises:
        ConfigError: an empty list, a repeated spec, or commas that could separate either specs or options.
    """
    text = text.strip()
    if ";" in text:
        parts = [p.strip() for p in text.split(";")]
    elif ":" not in text:
        parts = [p.strip() for p in text.split(",")]
    else:
        for side in text.split("@"):
            try:
                name, _ = parse_spec(side)
            except ConfigError:
                name = ","
            if "," in name:
                raise ConfigError(f"matrix: field '{field}': {text!r} is ambiguous (a comma separates both specs and "
                                  f"a spec's options); separate specs with ';', e.g. --{field} \"{example}\"")
        parts = [text]
    parts = [p for p in parts if p]
    if not parts:
        raise ConfigError(f"matrix: field '{field}': no specs given; e.g. --{field} \"{example}\"")
    seen = {p for p in parts if parts.count(p) > 1}
    if seen:
        raise ConfigError(f"matrix: field '{field}': spec(s) {', '.join(sorted(seen))} given twice; give each once")
    return parts


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_.") or "cell"


def parse_cells(algos: str | Sequence[str], allocators: str | Sequence[str]) -> list[Cell]:
    """Every ``algo x allocator[@sampler]`` cell, algorithms outermost.

    Args:
        algos: ``"grpo;ppo:lam=0.95"`` or a list of algorithm specs.
        allocators: ``"ds;sara;sara:prior=history,decay=0.95@predictive"`` or a list of ``ALLOCATOR[@SAMPLER]``.

    Raises:
        ConfigError: naming the field, for a malformed list or an empty allocator / sampler around ``@``.
    """
    algo_list = parse_specs(algos, "algos", example="grpo;ppo:lam=0.95") if isinstance(algos, str) else list(algos)
    alloc_list = (parse_specs(allocators, "allocators", example="ds;sara:prior=history,decay=0.95@predictive")
                  if isinstance(allocators, str) else list(allocators))
    for a in algo_list:
        if "@" in a:
            raise ConfigError(f"matrix: field 'algos': {a!r}: '@SAMPLER' belongs to an allocator spec "
                              "(--allocators \"sara@predictive\")")
    cells: list[Cell] = []
    names: set[str] = set()
    for algo in algo_list:
        for spec in alloc_list:
            pair = parse_allocation(spec, field="allocators", what="matrix")
            base = name = _safe(f"{algo}-{spec}")
            i = 2
            while name.lower() in names:  # unique, also on case-insensitive filesystems
                name, i = f"{base}-{i}", i + 1
            names.add(name.lower())
            cells.append(Cell(algo, pair.allocator, pair.sampler, spec, name))
    return cells
