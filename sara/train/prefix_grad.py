"""The prefix every row of a mini-batch shares (a task's few-shot preamble), forwarded ONCE for all its micro-batches.

``SharedPrefix.forward`` runs the prefix through the policy (``PrefixScorer.prefix_kv``) and, when that forward has a
graph, swaps its per-layer keys / values for detached leaves that require gradient. Every micro-batch's ``score_at``
gets those leaves (``prefix=``) instead of running the prefix again, and its ``loss.backward()`` adds its share of the
prefix's gradient to them (besides the parameters' gradients). After the mini-batch's last micro-batch,
``SharedPrefix.backward`` sends the summed leaf gradients through the prefix's forward once: the parameters then hold
the gradient that forwarding the prefix in every micro-batch gives (the chain rule is linear in the upstream
gradient), to float rounding, with one forward and one backward of the prefix instead of one per micro-batch.
Without gradient (the learner's no-grad scoring) the keys / values are given as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from sara.policies.base import PrefixKV, PrefixScorer, TokenBatch

__all__ = ["SharedPrefix"]


class SharedPrefix:
    """A prefix forwarded once, given to several ``score_at`` calls; its gradient goes back once (``backward``).

    Args:
        kv: The prefix's keys / values (``PrefixScorer.prefix_kv``).

    Attributes:
        kv: What the ``score_at`` calls get: detached leaves of ``kv``'s tensors that collect their gradients when
            ``kv`` has a graph, else ``kv`` itself.
    """

    def __init__(self, kv: PrefixKV) -> None:
        from sara.policies.base import PrefixKV

        self._source: list[torch.Tensor] = list(kv.tensors)
        if any(x.requires_grad for x in self._source):
            self.kv = PrefixKV(kv.length, [x.detach().requires_grad_() for x in self._source])
        else:
            self.kv, self._source = kv, []

    @classmethod
    def forward(cls, policy: PrefixScorer, batch: TokenBatch, length: int) -> SharedPrefix | None:
        """The first ``length`` tokens of ``batch``'s rows (all the same) forwarded once by ``policy``.

        Args:
            policy: The policy whose ``score_at`` calls get the prefix.
            batch: Rows that all start with the same ``length`` tokens.
            length: Tokens of the prefix (0: none).

        Returns:
            The forwarded prefix, or None when ``length`` is 0 or the policy cannot give keys / values now.
        """
        if length <= 0:
            return None
        kv = policy.prefix_kv(batch, length)
        return None if kv is None else cls(kv)

    def backward(self) -> None:
        """Send the gradients the ``score_at`` calls' backward passes left on the leaves through the prefix's forward,
        once, into the parameters (accumulated into their ``.grad``); then drop the prefix's graph. Nothing without
        gradient."""
        import torch

        pairs = [(x, leaf.grad) for x, leaf in zip(self._source, self.kv.tensors) if leaf.grad is not None]
        self._source = []
        if pairs:
            torch.autograd.backward([x for x, _ in pairs], grad_tensors=[g for _, g in pairs])
