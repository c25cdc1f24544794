"""Surplus committed groups: train them in this step's batch, or bank them for the next step's.

A collection step can commit more groups than its target: ``sara`` drains its probing units into groups when the
target is reached (``drain``), a streaming driver's last rollouts land together, DS commits whole rounds. Trained at
once (``surplus='train'``), the surplus grows the batch: the rollouts it saved become a bigger batch, not another
optimizer step. Banked (``surplus='bank'``, the default), the batch stays ``groups_per_step`` groups and the surplus
opens the next step's batch, whose collection then only needs what is missing, so rollouts saved per effective group
become more optimizer steps at the same rollout budget.

Lag is bounded by one weight update: every banked group is trained in the very next step (if the bank ever holds more
than a batch, that batch grows rather than waiting); the learner's micro-batches (``OptimConfig.microbatch_tokens``)
keep memory flat whatever the batch, and DS's ``max_oversample`` caps the surplus where it is made. A banked rollout
carries the weights version that generated it (``Rollout.policy_version``), so the learner trains it with its
generator's log-probs as old log-probs
(``sara.train.batch.make_batch``: stale rows), as it does for the streaming driver's carried rollouts. The run's
last step (or the one that spends the rollout budget) banks nothing (``flush``): no rollout is left untrained. A checkpoint holds the bank (``state_dict``: rollouts with their token ids and log-probs; prompts by pool
index), so a run resumed from any checkpoint trains the same batches as the uninterrupted one.

Group ids are unique only within a collection step; the batch renumbers its groups ``0..n-1`` so a banked group never
merges with a fresh one of the same id (advantages are computed per id).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from sara.types import Decision, Group, Prompt, Rollout

__all__ = ["SurplusBank", "SurplusMode", "batch_reward_variance"]

SurplusMode = Literal["train", "bank"]


def batch_reward_variance(groups: Sequence[Group]) -> float:
    """Mean over the batch's groups of their rewards' variance (``train/group_reward_var``): the signal a group-relative
    advantage has to work with before normalization (binary rewards: p(1 - p) of the group's own success rate, 0.25
    at most; 0 for an empty batch)."""
    return float(np.mean([g.rewards.var() for g in groups])) if groups else 0.0


class SurplusBank:
    """The committed groups a step produced beyond its batch, kept for the next step.

    Args:
        batch_groups: Groups per training batch (``TrainConfig.groups_per_step``).
        mode: ``'bank'`` keeps the surplus for the next step; ``'train'`` trains every committed group at once.
    """

    def __init__(self, batch_groups: int, mode: SurplusMode = "bank") -> None:
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        if mode not in ("train", "bank"):
            raise ValueError(f"mode must be 'train' or 'bank', got {mode!r}")
        self.batch_groups, self.mode = int(batch_groups), mode
        self.groups: list[Group] = []

    def __len__(self) -> int:
        return len(self.groups)

    def need(self) -> int:
        """Groups the next collection step should commit: the batch minus what the bank already holds (at least 1,
        so every step collects and the sampler, the prior and the budget move on)."""
        return max(1, self.batch_groups - len(self.groups))

    def batch(self, fresh: Sequence[Group], *, flush: bool = False) -> list[Group]:
        """This step's training batch from the banked groups and the step's ``fresh`` committed groups.

        Every banked group is in it (oldest first), then fresh groups up to ``batch_groups``; the rest of the fresh
        ones are banked unless ``flush`` or mode ``'train'``, which train everything now. Groups are renumbered
        ``0..n-1`` in batch order.
        """
        fresh = list(fresh)
        if self.mode == "train" or flush:
            take, keep = fresh, []
        else:
            room = max(0, self.batch_groups - len(self.groups))
            take, keep = fresh[:room], fresh[room:]
        out = [*self.groups, *take]
        self.groups = keep
        return [dataclasses.replace(g, group_id=i) for i, g in enumerate(out)]

    def state_dict(self) -> dict[str, Any]:
        """The banked groups as plain data (``sara.train.codec`` stores it; prompts by pool index)."""
        return {"groups": [{"group_id": g.group_id, "pool_index": g.pool_index, "decision": int(g.decision),
                            "metadata": dict(g.metadata),
                            "rollouts": [{f.name: getattr(r, f.name) for f in dataclasses.fields(Rollout)}
                                         for r in g.rollouts]} for g in self.groups]}

    def load_state_dict(self, state: Mapping[str, Any], prompts: Sequence[Prompt]) -> None:
        """Restore what ``state_dict`` returned; ``prompts``: the training pool (``env.prompts``)."""
        self.groups = [Group(group_id=int(g["group_id"]), prompt=prompts[int(g["pool_index"])],
                             pool_index=int(g["pool_index"]), decision=Decision(int(g["decision"])),
                             metadata=dict(g["metadata"]), rollouts=tuple(Rollout(**r) for r in g["rollouts"]))
                       for g in state.get("groups", [])]
