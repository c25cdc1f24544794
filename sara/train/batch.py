"""A batch of committed rollouts as padded tensors (``Batch``, ``make_batch``): what the learner trains on.

Rows are rollouts, grouped by their group's id (any group size); prompt and completion token ids are right-padded
into one ``TokenBatch``; ``resp_index`` / ``response_mask`` locate each row's response. Shapes: ``N`` rollouts, ``T``
prompt + response positions, ``R`` response positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import torch

    from sara.types import Group

__all__ = ["Batch", "make_batch", "rows_of"]


def rows_of(x: torch.Tensor | None, idx: torch.Tensor | None) -> torch.Tensor | None:
    """``x[idx]``, or ``x`` when either is None (an optional per-row tensor; None = every row)."""
    return x if x is None or idx is None else x[idx]


@dataclass
class Batch:
    """The committed rollouts as padded tensors (``N`` rollouts, ``T`` full length, ``R`` response length)."""

    tokens: Any  # TokenBatch over prompt + response [N, T]
    resp_index: Any  # [N, R] positions of response tokens in the full sequence
    response_mask: Any  # [N, R]
    rewards: Any  # [N]
    group_ids: Any  # [N]
    gen_logprobs: Any  # [N, R] log-probs reported by the generator
    stale: Any = None  # [N] bool: started under older weights than the learner's (banked, carried); None = none
    prompt_lens: Any = None  # [N] prompt tokens per row (None: resp_index[:, 0])

    def rows(self, idx: torch.Tensor) -> Batch:
        """The sub-batch of rollouts ``idx`` (a mini-batch)."""
        from sara.policies.base import TokenBatch

        t = self.tokens
        return Batch(TokenBatch(t.input_ids[idx], t.attention_mask[idx], t.response_mask[idx]), self.resp_index[idx],
                     self.response_mask[idx], self.rewards[idx], self.group_ids[idx], self.gen_logprobs[idx],
                     rows_of(self.stale, idx), self.prompts()[idx])

    def prompts(self) -> torch.Tensor:
        """Prompt tokens per row ``[N]``."""
        return cast("torch.Tensor", self.prompt_lens if self.prompt_lens is not None else self.resp_index[:, 0])


def make_batch(groups: Sequence[Group], device: torch.device | str = "cpu", version: int | None = None) -> Batch | None:
    """Pad prompt + response tokens of the rollouts of ``groups`` (grouped by id, any group size); None if empty.

    With ``version`` (the weights the learner holds), a rollout generated under an older ``Rollout.policy_version``
    (a banked group, a carried rollout) is marked ``stale`` (``Batch.stale``).

    Raises:
        RuntimeError: a rollout without prompt or completion token ids (the backend must return them).
    """
    import torch

    from sara.policies.base import TokenBatch

    rows = [(g.group_id, r) for g in groups for r in g.rollouts]
    if not rows:
        return None
    pairs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # each row's (prompt, completion) token ids
    for _, r in rows:
        if r.token_ids is None or r.prompt_token_ids is None:
            raise RuntimeError("the backend must return prompt and completion token ids to train on them")
        pairs.append((r.prompt_token_ids, r.token_ids))
    lens_p, lens_r = [len(p) for p, _ in pairs], [len(c) for _, c in pairs]
    n, t, big_r = len(rows), max(p + q for p, q in zip(lens_p, lens_r)), max(max(lens_r), 1)
    ids = torch.zeros(n, t, dtype=torch.long)
    attn = torch.zeros(n, t, dtype=torch.long)
    gen_lp = torch.zeros(n, big_r)
    for i, ((_, r), (prompt, completion)) in enumerate(zip(rows, pairs)):
        seq = list(prompt) + list(completion)
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[i, : len(seq)] = 1
        if r.logprobs:
            gen_lp[i, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
    j = torch.arange(big_r)
    resp_index = (torch.tensor(lens_p)[:, None] + j).clamp(max=t - 1)
    resp_mask = (j[None, :] < torch.tensor(lens_r)[:, None]).float()
    full_mask = torch.zeros(n, t)
    full_mask.scatter_reduce_(1, resp_index, resp_mask, reduce="amax")  # clamped pad indices never unset a 1
    tokens = TokenBatch(input_ids=ids.to(device), attention_mask=attn.to(device), response_mask=full_mask.to(device))
    rewards = torch.tensor([r.reward for _, r in rows], dtype=torch.float32, device=device)
    gids = torch.tensor([gid for gid, _ in rows], dtype=torch.long, device=device)
    # a stale rollout without generator log-probs keeps the trainer's (nothing to correct with)
    old = [version is not None and bool(r.logprobs) and r.policy_version is not None and r.policy_version < version
           for _, r in rows]
    stale = torch.tensor(old, dtype=torch.bool, device=device) if any(old) else None
    return Batch(tokens, resp_index.to(device), resp_mask.to(device), rewards, gids, gen_lp.to(device), stale,
                 torch.tensor(lens_p, dtype=torch.long, device=device))
