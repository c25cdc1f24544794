"""How many rows the HF backend decodes together: its row cap and its KV-cache budget, sized from the model and memory.

A decoding row holds its keys and values for every position of its prompt (left-padded to its batch's widest) and
of the tokens it may still generate. One position costs ``kv_bytes_per_position`` (layers x 2 x key-value heads x
head size x the copy's element size: 46 KB in float32 for SmolLM2-135M). ``HFBackendConfig.kv_cache_gib`` bounds
what one batch's cache may take; ``auto`` (the default) is ``1 / KV_SHARE`` of the memory the process may use (the
machine's, or the CUDA device's, ``sara.memory``), so that the generating copy's cache stays a bounded part of a
run's peak on any machine. ``max_batch_size`` caps the rows whatever the memory.

Both decode loops keep the bound: the round loop (``HFBackend.generate``) cuts its rows into chunks that fit
(``chunk_rows``), and the streaming loop (``sara.backends.hf_stream``) admits a queued row only while the running
batch, the newcomers and the room they decode into fit. A row that does not fit alone still runs, alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

__all__ = ["KV_SHARE", "KVBudget", "chunk_rows", "kv_budget", "kv_bytes_per_position"]

KV_SHARE = 8
"""``kv_cache_gib: auto`` keeps one batch's KV cache within this fraction (1/8) of the memory the process may use:
about 2.9 GiB of a 24 GiB machine, where 64 float32 rows of SmolLM2-135M at reasoning length (a few-shot prompt of
about 440 tokens and 64 new ones: 1.5 GB) fit, so the bound leaves that batch as it is and binds on smaller machines."""
GIB = 1024**3


class Sized(Protocol):
    """What ``chunk_rows`` reads of a row: its request, its prompt and how many tokens it may still generate."""

    request: int
    prompt_ids: list[int]
    cap: int


R = TypeVar("R", bound=Sized)


@dataclass(frozen=True)
class KVBudget:
    """A resolved KV-cache budget.

    Attributes:
        positions: Cached positions one batch may hold (rows x padded positions), None for no bound.
        reason: Why, in words fit for a run's first lines.
    """

    positions: int | None
    reason: str

    def line(self) -> str:
        """E.g. ``generation KV cache: at most 61,000 positions (auto: 45.0 KiB a position, 1/8 of 23.5 GiB)``."""
        bound = "no bound" if self.positions is None else f"at most {self.positions:,} positions"
        return f"generation KV cache: {bound} ({self.reason})"

    def max_rows(self, positions: int) -> int | None:
        """How many rows of ``positions`` cached positions each fit (at least one; None: no bound)."""
        return None if self.positions is None else max(1, self.positions // max(1, positions))

    def fits(self, rows: int, positions: int) -> bool:
        """Whether ``rows`` rows of ``positions`` cached positions each fit (always True for one row)."""
        most = self.max_rows(positions)
        return most is None or rows <= most


def kv_bytes_per_position(shape: Mapping[str, Any], element_bytes: int) -> int | None:
    """Bytes the keys and values of one cached position take across the model's layers.

    Args:
        shape: The model's ``config.json`` (``num_hidden_layers``, ``num_attention_heads``, ``hidden_size``, and
            ``num_key_value_heads`` / ``head_dim`` where the model has them).
        element_bytes: Bytes per cached value (4 in float32, 2 in bfloat16 / float16).

    Returns:
        The bytes, or None for a config without those fields.
    """
    try:
        layers = int(shape["num_hidden_layers"])
        heads = int(shape["num_attention_heads"])
        kv_heads = int(shape.get("num_key_value_heads") or heads)
        head_dim = int(shape.get("head_dim") or int(shape["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return int(layers * 2 * kv_heads * head_dim * int(element_bytes))


def kv_budget(want: float | Literal["auto"], per_position: int | None, memory: int | None) -> KVBudget:
    """Resolve ``HFBackendConfig.kv_cache_gib``.

    Args:
        want: GiB for one batch's cache, or ``auto`` (``1 / KV_SHARE`` of ``memory``).
        per_position: ``kv_bytes_per_position`` of the generating copy (None: unknown, no bound).
        memory: Bytes the process may use (None: unknown; ``auto`` is then no bound).
    """
    if per_position is None or per_position <= 0:
        return KVBudget(None, "the model's config does not give its key-value shape")
    kib = f"{per_position / 1024:.1f} KiB a position"
    if want == "auto":
        if memory is None or memory <= 0:
            return KVBudget(None, "auto: this machine's memory is unknown")
        return KVBudget(max(1, memory // KV_SHARE // per_position),
                        f"auto: {kib}, 1/{KV_SHARE} of {memory / GIB:.1f} GiB")
    return KVBudget(max(1, int(float(want) * GIB) // per_position), f"kv_cache_gib={want:g}: {kib}")


def chunk_rows(rows: Sequence[R], max_rows: int, budget: KVBudget) -> list[list[R]]:
    """Cut ``rows`` (a round's, grouped by request) into chunks decoded one after another.

    A chunk holds at most ``max_rows`` rows and fits ``budget`` (rows x (its widest prompt + its largest cap)); a
    request's rows stay in one chunk when they fit, and are split across chunks when they do not.
    """
    chunks: list[list[R]] = []
    cur: list[R] = []
    width = cap = 0  # the current chunk's widest prompt and largest cap

    def fits(extra: Sequence[R]) -> bool:
        w = max([width, *(len(r.prompt_ids) for r in extra)])
        c = max([cap, *(r.cap for r in extra)])
        return len(cur) + len(extra) <= max_rows and budget.fits(len(cur) + len(extra), w + c)

    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j].request == rows[i].request:
            j += 1
        group = list(rows[i:j])
        if cur and not fits(group):
            chunks.append(cur)
            cur, width, cap = [], 0, 0
        for row in group:  # whole when the group fits, else split
            if cur and not fits([row]):
                chunks.append(cur)
                cur, width, cap = [], 0, 0
            cur.append(row)
            width, cap = max(width, len(row.prompt_ids)), max(cap, row.cap)
        i = j
    if cur:
        chunks.append(cur)
    return chunks
