"""Advantage weights from the allocator: trained groups reweighted toward DS's batch composition (``sara:reweight=ds``).

An allocator that stops some groups' prompts early fills its batch with the groups that mix cheaply; a group it
abandons early gets fewer trained groups than DS would give it, and a policy that has not yet learned that group is
trained on it less and less (docs/allocation.md: the Reverse task). An allocator implementing ``WeighsBatch`` gives
each rollout of the batch a weight (mean 1); the policy-gradient advantages are scaled by it, row by row. The rollouts
collected are unchanged; values and returns are not reweighted.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from sara.types import Group

if TYPE_CHECKING:
    import torch

__all__ = ["Advantages", "weigh_advantages"]

Advantages: TypeAlias = "torch.Tensor"
"""``[N, R]`` advantages, one row per rollout of a batch (``sara.train.learner``)."""


def weigh_advantages(allocator: object, groups: Sequence[Group], advantages: Advantages | None,
                     extra: MutableMapping[str, Any]) -> Advantages | None:
    """``advantages [N, R]`` (rows: the rollouts of ``groups`` in order) times the allocator's row weights, or as they
    are when it gives none; the largest weight goes to ``extra["metrics"]["algo/max_row_weight"]``."""
    from sara.allocators import WeighsBatch

    if advantages is None or not isinstance(allocator, WeighsBatch):
        return advantages
    w = allocator.batch_weights(np.array([g.pool_index for g in groups], np.int64),
                                np.array([g.size for g in groups], np.int64))
    if w is None:
        return advantages
    import torch

    if len(w) != advantages.shape[0]:
        raise ValueError(f"batch_weights gave {len(w)} weights for {advantages.shape[0]} rows")
    extra.setdefault("metrics", {})["algo/max_row_weight"] = float(np.max(w))
    return advantages * torch.as_tensor(w, dtype=advantages.dtype, device=advantages.device)[:, None]
