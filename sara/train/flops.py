"""A run's FLOP floor: the matmul FLOPs its work cannot avoid, so its seconds can be set beside the machine's rate.

Counted from the rollouts and the trained groups themselves (their real lengths, no padding):

* **generation** (training and evaluation): the prompts' shared preamble once per call (one weights version), every
  distinct prompt's tokens after it once, and every generated token's forward through the weights, the LM head and
  the attention to the positions before it;
* **update**: per epoch, one forward and its backward (3x a forward) of the batch's shared preamble once, every
  distinct prompt after it once, and every trained row's completion (the LM head at completion tokens only).

A forward through the decoder's weight matrices costs ``2 x params`` per position, the LM head ``2 x V x D`` per
projected position and the attention ``4 x layers x heads x head_dim`` per (query, key) pair (``ModelFlops``).
``sara train`` prints the floor's seconds at this machine's measured matmul rate beside the run's; ``sara bench
learner`` counts one update's FLOPs with the same ``ModelFlops``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sara.train.microbatch import shared_prefix
from sara.types import Rollout

if TYPE_CHECKING:
    import torch

__all__ = ["FLOP_PARTS", "FlopFloor", "ModelFlops", "floor_seconds", "matmul_gflops"]

FLOP_PARTS = ("collect", "update", "eval")
"""The parts of a run's FLOP floor, each a ``flops_<part>`` entry of the trainer's totals."""


@dataclass(frozen=True)
class ModelFlops:
    """Matmul FLOPs of one forward of a decoder-only transformer, by what they grow with.

    Attributes:
        position: FLOPs of one position through the decoder's weight matrices (``2 x`` their parameters; the
            embeddings are a lookup).
        head: FLOPs of one position's vocabulary projection (``2 x V x D``).
        pair: FLOPs of the attention (``QK^T`` and ``AV``) for one (query, key) pair over every layer and head.
    """

    position: float
    head: float
    pair: float

    @classmethod
    def of(cls, module: object) -> ModelFlops:
        """The counts of a Hugging Face causal LM (``transformers.PreTrainedModel``)."""
        from transformers import PreTrainedModel

        if not isinstance(module, PreTrainedModel):
            raise TypeError(f"ModelFlops.of needs a transformers PreTrainedModel, not {type(module).__name__}")
        cfg, head = module.config, module.get_output_embeddings().weight
        skip = {id(module.get_input_embeddings().weight), id(head)}
        body = sum(p.numel() for p in module.parameters() if p.dim() >= 2 and id(p) not in skip)
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        return cls(position=2.0 * body, head=2.0 * head.numel(),
                   pair=4.0 * int(cfg.num_hidden_layers) * heads * head_dim)

    def span(self, lo: float, hi: float) -> float:
        """Positions ``lo .. hi-1`` forwarded, each attending to itself and every position before it (no LM head)."""
        return (hi - lo) * self.position + (hi * (hi + 1) - lo * (lo + 1)) / 2 * self.pair

    def decode(self, context: float, tokens: float) -> float:
        """``tokens`` generated after ``context`` positions: each one position, its logits and its attention."""
        return self.span(context, context + tokens) + tokens * self.head


def _prompt(r: Rollout) -> tuple[int, ...]:
    return r.prompt_token_ids or ()


class FlopFloor:
    """The FLOP floor of a run's generation calls and updates (NaN for a policy that is no Hugging Face causal LM).

    Args:
        model: The policy's counts (``ModelFlops.of`` its module); None: unknown, every floor NaN.
    """

    def __init__(self, model: ModelFlops | None) -> None:
        self.model = model

    @classmethod
    def of_policy(cls, policy: object) -> FlopFloor:
        """The floor of ``policy``'s module when it is a ``sara.policies.hf.HFPolicy``, else an unknown one."""
        from sara.policies.hf import HFPolicy

        return cls(ModelFlops.of(policy.model) if isinstance(policy, HFPolicy) else None)

    def generation(self, rollouts: Iterable[Rollout]) -> float:
        """The floor of generating ``rollouts`` in one call (one weights version): their shared preamble once, each
        distinct prompt after it once, and every generated token (a rollout without prompt token ids: its tokens)."""
        if self.model is None:
            return math.nan
        m, rs = self.model, list(rollouts)
        prompts = {_prompt(r) for r in rs}
        shared = shared_prefix(sorted(prompts))
        flops = m.span(0, shared) + sum(m.span(shared, len(p)) for p in prompts)
        return flops + sum(m.decode(len(_prompt(r)), r.num_tokens) for r in rs)

    def update(self, groups: Iterable[Sequence[Rollout]], epochs: int) -> float:
        """The floor of ``epochs`` passes over a batch of ``groups`` (each a group's rollouts): a forward and its
        backward (3x a forward) of the shared preamble once, each distinct prompt after it once and every completion
        (the LM head at its tokens)."""
        return 3.0 * epochs * self.generation(r for g in groups for r in g)

    @staticmethod
    def add(totals: MutableMapping[str, float], part: str, flops: float) -> None:
        """Add ``flops`` to ``totals["flops_<part>"]`` (``part`` one of ``FLOP_PARTS``); a NaN (an unknown floor)
        leaves ``totals`` as they are, so a run's totals stay finite and hold no floor it could not count."""
        if part not in FLOP_PARTS:
            raise ValueError(f"part must be one of {FLOP_PARTS}, not {part!r}")
        if math.isfinite(flops):
            totals[f"flops_{part}"] = totals.get(f"flops_{part}", 0.0) + flops


def matmul_gflops(size: int, dtype: torch.dtype, *, reps: int = 5, max_seconds: float = 2.0) -> float:
    """Best GFLOP/s of square matmuls in ``dtype`` over ``reps`` timed calls, at most ``size x size``.

    A 256 x 256 probe first estimates the rate; the side is then the largest power-of-two multiple of 256 (up to
    ``size``) whose ``reps + 1`` calls fit in ``max_seconds``, so a dtype the CPU only emulates (bfloat16 without
    AVX512-BF16 or AMX multiplies many times slower) is measured on smaller matrices instead of waited for.
    """
    import torch

    gen = torch.Generator().manual_seed(0)

    def best_of(n: int, calls: int) -> float:
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(calls):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return max(best, 1e-9)

    n = min(256, size)
    rate = 2.0 * n**3 / best_of(n, 1)  # FLOP/s
    while n * 2 <= size and (reps + 1) * 2.0 * (n * 2) ** 3 / rate <= max_seconds:
        n *= 2
    return 2.0 * n**3 / best_of(n, reps) / 1e9


PART_DTYPE = {"collect": "generation", "update": "learner", "eval": "generation"}
"""Which of a run's resolved dtypes (``sara.train.dtypes.run_dtypes``) each part of the floor computes in."""


def part_rates(dtypes: Mapping[str, str], size: int = 2048) -> dict[str, float]:
    """Each part's matmul rate on this CPU (GFLOP/s, ``matmul_gflops``) at the dtype it computes in.

    Args:
        dtypes: The run's dtype names by role (``{"generation": "bfloat16", "learner": "float32"}``).
        size: The largest side of the measured square matmuls.
    """
    import torch

    measured = {name: matmul_gflops(size, getattr(torch, name), reps=3) for name in set(dtypes.values())}
    return {part: measured[dtypes[role]] for part, role in PART_DTYPE.items()}


def floor_seconds(flops: Mapping[str, float], gflops: Mapping[str, float]) -> float:
    """Seconds of ``flops`` (by part, ``FLOP_PARTS``) at ``gflops`` (each part's matmul rate in GFLOP/s)."""
    return sum(f / (gflops[part] * 1e9) for part, f in flops.items())
