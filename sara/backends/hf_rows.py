"""What the HF backend's two decode loops share: ``Row``, one completion being generated (the round loop in
``sara.backends.hf``, the slot-refill loop in ``sara.backends.hf_stream``), and ``DecodeHost``, the streaming
engine's view of the backend that owns it.

Both sit here, below the two loops, so that the streaming engine never imports the backend that creates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from sara.envs.base import SamplingConfig

__all__ = ["Row", "DecodeHost"]


@dataclass
class Row:
    """One completion being generated."""

    request: int
    prompt_ids: list[int]
    seed: int
    cap: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str = ""
    text: str | None = None


class DecodeHost(Protocol):
    """The backend as ``HFStreamEngine`` uses it (``sara.backends.hf.HFBackend`` is one): its model, tokenizer, EOS
    ids, weights version and token count, and the steps of decoding it shares with the round loop."""

    model: Any
    tokenizer: Any
    eos: Sequence[int]
    version: int
    tokens_generated: int

    @property
    def device(self) -> torch.device: ...

    def _between_steps(self) -> None: ...

    def _prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Any, torch.Tensor]: ...

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
                 ) -> tuple[torch.Tensor, Any]: ...

    def _hit_stop(self, row: Row, stops: Sequence[str]) -> bool: ...

    @staticmethod
    def _sample(logits: torch.Tensor, seeds: np.ndarray, t: int | np.ndarray, sampling: SamplingConfig
                ) -> tuple[torch.Tensor, torch.Tensor]: ...
