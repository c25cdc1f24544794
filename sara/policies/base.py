"""The trainable-policy interface the trainer uses (tiny transformer, HF causal LM, ...).

Kept small on purpose: the trainer needs log-probs of given tokens (for ratios, KL and entropy), an optional value
head (PPO), parameters for the optimizer, and weights to send to the generator.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["Policy", "TokenBatch"]


@dataclass
class TokenBatch:
    """A padded batch of prompt+response token sequences (torch tensors).

    Shapes: ``input_ids [B, T]`` (left part prompt, right part response, right-padded), ``attention_mask [B, T]``,
    ``response_mask [B, T]`` (1 on generated tokens that count in the loss). Log-probs are returned for every position
    ``t`` as the log-prob of ``input_ids[:, t]`` given ``input_ids[:, :t]`` (position 0 is 0).
    """

    input_ids: Any
    attention_mask: Any
    response_mask: Any


@runtime_checkable
class Policy(Protocol):
    """A trainable language policy."""

    has_value_head: bool

    def token_logprobs(self, batch: TokenBatch, *, with_entropy: bool = False) -> tuple[Any, Any | None]:
        """Return ``(logprobs [B, T], entropy [B, T] or None)`` aligned with ``batch.input_ids`` (see TokenBatch)."""
        ...

    def values(self, batch: TokenBatch) -> Any:
        """Value estimates ``[B, T]`` (only when ``has_value_head``)."""
        ...

    def parameters(self) -> Iterator[Any]:
        """Trainable parameters (torch)."""
        ...

    def state_dict(self) -> Mapping[str, Any]:
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> Any:
        ...
