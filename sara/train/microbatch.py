"""Micro-batches: a mini-batch split into forward passes under a token budget, rows grouped by their shared prefix.

The learner accumulates the gradients of a mini-batch's micro-batches and then takes ONE optimizer step, so the
budget (``OptimConfig.microbatch_tokens``) bounds the activations of one forward, not the batch a step trains.

A micro-batch is a set of rows and the number of leading tokens they all share (``prefix``): a ``PrefixScorer``
policy forwards those once and the rest of every row, right-padded to the micro-batch's longest row, so one costs
``prefix + rows x (width - prefix)`` forwarded positions (``MicroBatch.tokens``). ``plan_microbatches`` sorts the
rows by prompt (rows sharing a prefix become neighbours: a group's rows, then the groups of one few-shot preamble) and
cuts the sorted order into contiguous micro-batches that minimise the total forwarded positions plus
``CALL_OVERHEAD_TOKENS`` per micro-batch, each within the budget (dynamic programming over the cut points; a row
longer than the budget is a micro-batch of its own). Without prefix sharing the rows are sorted by length instead
(less padding).

When the prefix EVERY row shares (``shared_prefix``) is forwarded once for the whole mini-batch and its keys / values
given to each micro-batch (``PrefixScorer.prefix_kv``; ``plan_microbatches(..., given=...)``), a micro-batch forwards
only the part of its own prefix beyond it: ``prefix - given + rows x (width - prefix)`` positions.

The budget itself (``OptimConfig.microbatch_tokens``) is ``auto`` by default: ``microbatch_budget`` sizes it from what
one forwarded position keeps for the backward (which a policy reports through
``sara.policies.base.SizesActivations``, e.g. from its model's shape and compute dtype) so that one micro-batch's
activations take at most ``1 / ACTIVATION_SHARE`` of the memory the process may use (the machine's, or the CUDA device's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["ACTIVATION_SHARE", "CALL_OVERHEAD_TOKENS", "FALLBACK_MICROBATCH_TOKENS", "MIN_AUTO_MICROBATCH_TOKENS",
           "MicroBatch", "microbatch_budget", "microbatch_line", "plan_microbatches", "shared_prefix"]

ACTIVATION_SHARE = 24
"""``microbatch_tokens: auto`` keeps one micro-batch's activations within this fraction (1/24) of the memory the
process may use: 1 GiB of a 24 GiB machine, so that two runs fit side by side with their weights, optimizer state,
generating copy and libraries."""
FALLBACK_MICROBATCH_TOKENS = 2048
"""``auto``'s budget where the policy does not report its activations per position, or the memory is unknown."""
MIN_AUTO_MICROBATCH_TOKENS = 256
"""``auto`` never plans micro-batches smaller than this (a row longer than the budget is a micro-batch anyway)."""

CALL_OVERHEAD_TOKENS = 128
"""What one more forward call costs, in forwarded positions: per-call work that does not scale with the tokens (op
launches, casting the weights for autocast, the dense embedding / LM-head gradients, the prefix's own forward), from a
fit of micro-batch seconds to forwarded positions on SmolLM2-135M (docs/results.md, "Training internals"). It keeps
the plan from splitting rows over many calls to save a few positions each."""


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one forward pass.

    Attributes:
        rows: Indices into the mini-batch ``[n]`` (in prompt order).
        prefix: Leading tokens every row shares that are forwarded once (0 = none; always shorter than every row's
            prompt, so each row's first response token is predicted after the prefix).
        width: Positions of the longest row (the micro-batch's padded length).
        given: Leading tokens of ``prefix`` whose keys / values are given (forwarded once per mini-batch), 0 = none.
    """

    rows: np.ndarray
    prefix: int
    width: int
    given: int = 0

    @property
    def tokens(self) -> int:
        """Forwarded positions: the prefix beyond ``given`` once, then every row's remaining padded positions."""
        return self.prefix - self.given + len(self.rows) * (self.width - self.prefix)


def shared_prefix(prompts: Sequence[Sequence[int]], min_prefix: int = 8) -> int:
    """Leading tokens every row's prompt shares, at most the shortest prompt's length - 1; 0 if under ``min_prefix``.

    Args:
        prompts: Each row's prompt token ids.
        min_prefix: As in ``plan_microbatches``.
    """
    if not prompts:
        return 0
    common = min(_lcp(prompts[0], p) for p in prompts) if len(prompts) > 1 else len(prompts[0])
    common = min(common, min(len(p) for p in prompts) - 1)
    return common if common >= max(min_prefix, 1) else 0


def plan_microbatches(prompts: Sequence[Sequence[int]], lengths: Sequence[int], budget: int | None, *,
                      share: bool = True, min_prefix: int = 8, given: int = 0) -> list[MicroBatch]:
    """Split rows into micro-batches of at most ``budget`` forwarded positions (see the module docstring).

    Args:
        prompts: Each row's prompt token ids (a response starts right after its prompt).
        lengths: Each row's real length (prompt + response).
        budget: Most forwarded positions per micro-batch; None = one micro-batch of all rows.
        share: Plan shared prefixes (the policy is a ``PrefixScorer``); False = every prefix 0.
        min_prefix: The shortest shared prefix worth a forward of its own; shorter ones count as 0.
        given: Leading tokens every row shares whose keys / values the micro-batches are given (``shared_prefix``;
            with ``share``): not counted in any micro-batch's positions. 0 = every micro-batch forwards its prefix.

    Returns:
        Micro-batches covering every row exactly once.
    """
    n = len(prompts)
    if n == 0:
        return []
    given = given if share else 0
    lens = np.asarray(lengths, dtype=np.int64)
    plens = np.asarray([len(p) for p in prompts], dtype=np.int64)
    if share:
        order = np.asarray(sorted(range(n), key=lambda i: tuple(prompts[i])), dtype=np.int64)
    else:
        order = np.argsort(lens, kind="stable")
    # lcp[i]: leading tokens sorted rows i and i + 1 share (a range's common prefix is the minimum over its pairs)
    lcp = np.asarray([_lcp(prompts[order[i]], prompts[order[i + 1]]) if share else 0 for i in range(n - 1)],
                     dtype=np.int64)
    s_lens, s_plens = lens[order], plens[order]

    def prefix_of(common: np.ndarray) -> np.ndarray:
        return np.where(common >= max(min_prefix, 1), common, 0) if share else np.zeros_like(common)

    if budget is None:
        cuts = [0, n]
    else:
        best = np.full(n + 1, np.inf)
        best[0] = 0.0
        back = np.zeros(n + 1, dtype=np.int64)
        for j in range(1, n + 1):  # best[j]: the cheapest plan of sorted rows [0, j); its last micro-batch is [i, j)
            starts = np.arange(j - 1, max(j - 1 - budget, -1), -1)  # i = j-1, j-2, ...: a row costs >= 1 position
            width = np.maximum.accumulate(s_lens[starts])
            common = np.minimum(np.minimum.accumulate(np.concatenate([[np.iinfo(np.int64).max], lcp[starts[1:]]])),
                                np.minimum.accumulate(s_plens[starts]) - 1)
            prefix = prefix_of(common)
            size = j - starts
            tokens = np.maximum(prefix - given, 0) + size * (width - prefix)
            ok = (tokens <= budget) | (size == 1)
            last = len(ok) if ok.all() else int(np.argmin(ok))  # a range only gets dearer as it grows
            total = best[starts[:last]] + tokens[:last] + CALL_OVERHEAD_TOKENS
            k = int(np.argmin(total))
            best[j], back[j] = total[k], starts[k]
        cuts = [n]
        while cuts[-1] > 0:
            cuts.append(int(back[cuts[-1]]))
        cuts.reverse()
    out = []
    for i, j in zip(cuts[:-1], cuts[1:]):
        common = min(int(lcp[i:j - 1].min()) if j - i > 1 else np.iinfo(np.int64).max, int(s_plens[i:j].min()) - 1)
        shared = int(prefix_of(np.asarray([max(common, 0)]))[0])
        out.append(MicroBatch(rows=order[i:j], prefix=shared, width=int(s_lens[i:j].max()), given=min(given, shared)))
    return out


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def microbatch_budget(want: int | Literal["auto"] | None, per_token: int | None, memory: int | None
                      ) -> tuple[int | None, str]:
    """``OptimConfig.microbatch_tokens`` resolved: the budget and why.

    Args:
        want: The config's value: a number of positions, None (one forward per mini-batch) or ``"auto"``.
        per_token: What one forwarded position keeps for the backward, in bytes (``SizesActivations``; None:
            unknown).
        memory: The memory the process may use, in bytes (None: unknown).

    Returns:
        ``(positions or None, reason)``; ``auto`` gives ``memory / ACTIVATION_SHARE / per_token`` positions, at
        least ``MIN_AUTO_MICROBATCH_TOKENS``, or ``FALLBACK_MICROBATCH_TOKENS`` when either is unknown.
    """
    if want is None:
        return None, "one forward per mini-batch (microbatch_tokens: null)"
    if want != "auto":
        return int(want), "set in the config"
    if not per_token:
        return FALLBACK_MICROBATCH_TOKENS, ("auto: the policy does not say what a position's activations take, "
                                            f"{FALLBACK_MICROBATCH_TOKENS}")
    if not memory:
        return FALLBACK_MICROBATCH_TOKENS, f"auto: this machine's memory is unknown, {FALLBACK_MICROBATCH_TOKENS}"
    tokens = max(MIN_AUTO_MICROBATCH_TOKENS, memory // ACTIVATION_SHARE // per_token)
    return int(tokens), (f"auto: {per_token / 2**20:.2f} MiB of activations a position, 1/{ACTIVATION_SHARE} of "
                         f"{memory / 2**30:.1f} GiB")


def microbatch_line(tokens: int | None, reason: str) -> str:
    """What ``sara train`` prints about the budget: ``learner micro-batches: at most N positions (why)``."""
    if tokens is None:
        return f"learner micro-batches: {reason}"
    return f"learner micro-batches: at most {tokens:,} positions ({reason})"
