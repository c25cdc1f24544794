"""The trainable-policy interface the trainer uses (tiny transformer, HF causal LM, ...).

Kept small on purpose: the trainer needs ONE forward pass per mini-batch that returns log-probs of given tokens (for
ratios and KL), the entropy only when the loss uses it, and values only when the policy has a value head (PPO); plus
parameters for the optimizer and weights to send to the generator.

An optional capability, ``PrefixScorer`` (checked with ``isinstance``): score only chosen positions (the response
tokens), with the leading tokens that all rows share forwarded once (``HFPolicy``). The learner uses it when the policy
has it and falls back to ``score`` plus a gather otherwise (the tiny policy, whose prompts are a few characters).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["Policy", "PolicyOutput", "PrefixKV", "PrefixScorer", "ScoreViews", "TokenBatch"]


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


@dataclass
class PolicyOutput:
    """What one forward pass of a policy returns, every tensor ``[B, T]`` aligned with ``TokenBatch.input_ids``.

    ``logprobs[:, t]`` is log p(input_ids[t] | input_ids[:t]) (position 0 is 0); ``entropy[:, t]`` the entropy of
    that next-token distribution (None unless asked for); ``values[:, t]`` the value of the state before token ``t``
    (from the hidden state at ``t - 1``; position 0 is 0; None unless asked for).
    """

    logprobs: Any
    entropy: Any | None = None
    values: Any | None = None


@runtime_checkable
class Policy(Protocol):
    """A trainable language policy."""

    has_value_head: bool

    def score(self, batch: TokenBatch, *, with_entropy: bool = False, with_values: bool = False) -> PolicyOutput:
        """One forward pass: log-probs, plus the entropy / values when asked (values need ``has_value_head``)."""
        ...

    def parameters(self) -> Iterator[Any]:
        """Trainable parameters (torch)."""
        ...

    def state_dict(self) -> Mapping[str, Any]:
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> Any:
        ...


@dataclass
class PrefixKV:
    """The keys / values of a prefix forwarded once (``PrefixScorer.prefix_kv``), to give to ``score_at``.

    Attributes:
        length: Tokens of the prefix.
        tensors: Layer 0's keys, layer 0's values, layer 1's keys, ... (one row each, in the policy's own layout):
            a caller may swap them for detached leaves of the same shapes (``sara.train.prefix_grad``).
    """

    length: int
    tensors: list[Any]


@runtime_checkable
class PrefixScorer(Protocol):
    """A policy that scores chosen positions of rows sharing their first tokens, forwarding those tokens once.

    ``score_at(batch, at, prefix_len=P)`` equals ``score(batch)`` gathered at ``at`` (to float rounding) on every
    position whose ``batch.response_mask`` is 1; it runs the ``P`` leading tokens every row shares (a task's few-shot
    examples, a chat header) once, with gradient, broadcasts their keys / values to the rows, and computes the
    vocabulary projection only at the scored positions. ``prefix_kv`` forwards a prefix once for several ``score_at``
    calls (the learner's micro-batches of one mini-batch): each call then runs only what its rows share beyond it.
    """

    def score_at(self, batch: TokenBatch, at: Any, *, prefix_len: int = 0, with_entropy: bool = False,
                 with_values: bool = False, prefix: PrefixKV | None = None) -> PolicyOutput:
        """One forward pass, every output ``[B, R]`` at the positions ``at [B, R]`` of ``batch.input_ids [B, T]``.

        Args:
            batch: Right-padded rows; ``response_mask [B, T]`` says which positions count (outputs elsewhere may be
                0).
            at: Positions to score (``>= 1``); ``logprobs[i, j]`` is log p(input_ids[i, at[i, j]] | the tokens before).
            prefix_len: Every row starts with the same ``prefix_len`` tokens and every counted position of ``at`` is
                greater than ``prefix_len`` (its predecessor lies after the prefix). 0 = nothing shared. The policy may
                share fewer tokens (the result is the same).
            with_entropy, with_values: As in ``Policy.score``.
            prefix: The keys / values of the first ``prefix.length <= prefix_len`` tokens of every row
                (``prefix_kv``): they are not forwarded again, and only tokens ``prefix.length..prefix_len-1`` run
                as the shared prefix. None = forward the shared prefix here.
        """
        ...

    def prefix_kv(self, batch: TokenBatch, prefix_len: int) -> PrefixKV | None:
        """The first ``prefix_len`` tokens of ``batch``'s first row forwarded once (with gradient when enabled).

        Args:
            batch: Rows that all start with the same ``prefix_len`` tokens (only the first row is read).
            prefix_len: Tokens of the prefix (``>= 1``).

        Returns:
            Their keys / values for ``score_at(..., prefix=...)``, or None when the policy cannot take given keys /
            values now (e.g. under gradient checkpointing): the caller then calls ``score_at`` without ``prefix``.
        """
        ...


@runtime_checkable
class SizesActivations(Protocol):
    """A policy that says what one forwarded position keeps for the backward pass (the learner sizes its
    micro-batches by it: ``OptimConfig.microbatch_tokens: auto``)."""

    def activation_bytes_per_token(self) -> int | None:
        """Bytes of activations one position of a training forward keeps until its backward (None: unknown)."""
        ...


class ScoreViews:
    """``token_logprobs`` and ``values`` as views of ``score`` (for policies that implement ``score``)."""

    def token_logprobs(self, batch: TokenBatch, *, with_entropy: bool = False) -> tuple[Any, Any | None]:
        """``(logprobs [B, T], entropy [B, T] or None)``: ``score`` without values."""
        out = self.score(batch, with_entropy=with_entropy)  # type: ignore[attr-defined]
        return out.logprobs, out.entropy

    def values(self, batch: TokenBatch) -> Any:
        """Value estimates ``[B, T]``: ``score(batch, with_values=True).values``."""
        return self.score(batch, with_values=True).values  # type: ignore[attr-defined]

