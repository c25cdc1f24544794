"""The prefix every row of a mini-batch shares (a task's few-shot preamble), forwarded ONCE for all its micro-batches.

``SharedPrefix.forward`` runs the prefix through the policy (``PrefixScorer.prefix_kv``) without a graph and makes its
per-layer keys / values leaves that require gradient. Every micro-batch's ``score_at`` gets those leaves (``prefix=``)
instead of running the prefix again, and its ``loss.backward()`` adds its share of the prefix's gradient to them
(besides the parameters' gradients). After the mini-batch's last micro-batch, ``SharedPrefix.backward`` forwards the
prefix again, now with a graph, and sends the summed leaf gradients through it once: the parameters then hold the
gradient that forwarding the prefix in every micro-batch gives (the chain rule is linear in the upstream gradient),
to float rounding, with two forwards and one backward of the prefix instead of a forward and a backward per
micro-batch. The prefix's activations exist only in that last backward, not through every micro-batch (for an 8-shot
preamble of ~420 tokens on SmolLM2, several hundred MB). Without gradient (the learner's no-grad scoring) the keys /
values are given as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:

    from sara.policies.base import PrefixKV, PrefixScorer, TokenBatch

__all__ = ["SharedPrefix"]


class SharedPrefix:
    """A prefix forwarded once, given to several ``score_at`` calls; its gradient goes back once (``backward``).

    Args:
        kv: The prefix's keys / values (``PrefixScorer.prefix_kv``), computed without a graph.
        recompute: Forwards the prefix again with a graph (the same keys / values); None: no gradient is wanted.

    Attributes:
        kv: What the ``score_at`` calls get: ``kv``, its tensors leaves that collect their gradients when
            ``recompute`` is given.
    """

    def __init__(self, kv: PrefixKV, recompute: Callable[[], PrefixKV | None] | None = None) -> None:
        self.kv, self._recompute = kv, recompute
        if recompute is not None:
            for x in kv.tensors:
                x.requires_grad_()

    @classmethod
    def forward(cls, policy: PrefixScorer, batch: TokenBatch, length: int) -> SharedPrefix | None:
        """The first ``length`` tokens of ``batch``'s rows (all the same) forwarded once by ``policy``, without a graph
        (when gradient is enabled, ``backward`` forwards them again with one).

        Args:
            policy: The policy whose ``score_at`` calls get the prefix.
            batch: Rows that all start with the same ``length`` tokens.
            length: Tokens of the prefix (0: none).

        Returns:
            The forwarded prefix, or None when ``length`` is 0 or the policy cannot give keys / values now.
        """
        import torch

        if length <= 0:
            return None
        grad = torch.is_grad_enabled()
        with torch.no_grad():
            kv = policy.prefix_kv(batch, length)
        if kv is None:
            return None
        return cls(kv, (lambda: policy.prefix_kv(batch, length)) if grad else None)

    def backward(self) -> None:
        """Forward the prefix again with a graph and send the gradients the ``score_at`` calls' backward passes left on
        the leaves through it, once, into the parameters (accumulated into their ``.grad``). Nothing without
        gradient, or when no call used the prefix's keys / values."""
        import torch

        recompute, self._recompute = self._recompute, None
        grads = [leaf.grad for leaf in self.kv.tensors]
        if recompute is None or all(g is None for g in grads):
            return
        again = recompute()
        if again is None:
            raise RuntimeError("SharedPrefix.backward: the policy gave no keys / values the second time")
        pairs = [(x, g) for x, g in zip(again.tensors, grads, strict=True) if g is not None]
        torch.autograd.backward([x for x, _ in pairs], grad_tensors=[g for _, g in pairs])
