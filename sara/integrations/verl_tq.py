"""The TransferQueue and tensordict calls of the verl integration, in one place (imported lazily: ``transfer_queue``,
``tensordict``, ``torch`` and verl load on first use).

Key layout (verl 0.9.1, ``ReplayBuffer``): a prompt key is a uid without ``_`` whose tag is ``{"is_prompt": True,
"status": pending | running | finished | failure, "global_steps": s}``; a trajectory key is ``{uid}_{session}_{index}``
whose tag gets ``"status": "success"`` after its fields are stored.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sara.integrations.verl_agent_loop import SEEDS, first_value

__all__ = ["TQ", "Submission", "held_uid", "pool_index_of", "prompt_tags"]


@dataclass
class Submission:
    """One launched row: a TransferQueue prompt key and the driver tag of each of its sessions."""

    uid: str
    base: str  # the unit's uid (the prompt key verl registered); GRPO groups the unit's rollouts under it
    tags: list[int]
    terminal: bool = False


def held_uid(key: str) -> str:
    """The prompt key a TransferQueue key belongs to (itself for a prompt key)."""
    return key.split("_", 1)[0]


def pool_index_of(row: Any) -> int:
    """Pool index of a verl prompt row: its ``index`` column (``extra_info.index`` in verl's datasets)."""
    if "index" not in row.keys():
        raise ValueError("verl prompt row has no 'index' column: give every dataset row extra_info.index (verl's "
                         "data_preprocess scripts do), the prompt's identity for sara's priors")
    return int(first_value(row, "index"))


def prompt_tags(n: int, global_steps: int) -> list[dict[str, Any]]:
    """Tags of freshly registered prompt keys (what verl's ``_submit_batch_to_rollout`` writes)."""
    return [{"is_prompt": True, "status": "pending", "global_steps": int(global_steps)} for _ in range(n)]


class TQ:
    """TransferQueue access of the integration (the in-process client of ``transfer_queue``, one partition).

    Args:
        partition_id: The TransferQueue partition (``"train"``).
    """

    def __init__(self, partition_id: str = "train") -> None:
        import transfer_queue

        self.tq = transfer_queue
        self.partition_id = partition_id

    def listing(self) -> dict[str, dict[str, Any]]:
        """``{key: tag}`` of the partition."""
        data = self.tq.kv_list(self.partition_id) or {}
        return dict(data.get(self.partition_id, {}) or {})

    def sessions_and_status(self, subs: Mapping[str, Any]
                            ) -> tuple[dict[tuple[str, int], list[tuple[str, dict]]], dict[str, str]]:
        """Landed sessions ``(uid, session) -> [(key, tag)]`` (sorted by output index) and the status of the prompt
        keys in ``subs``."""
        sessions: dict[tuple[str, int], list[tuple[int, str, dict]]] = defaultdict(list)
        status: dict[str, str] = {}
        for key, tag in self.listing().items():
            if "_" not in key:
                if key in subs:
                    status[key] = str(tag.get("status"))
                continue
            uid, s, i = key.rsplit("_", 2)
            if uid in subs and tag.get("status") == "success" and int(s) < len(subs[uid].tags):
                sessions[(uid, int(s))].append((int(i), key, tag))
        return {loc: [(k, t) for _, k, t in sorted(v)] for loc, v in sessions.items()}, status

    def rewards(self, keys: Sequence[str]) -> list[float] | None:
        """``rm_scores.sum()`` per key (the scalar reward verl's agent loop stored); None while fields are not ready."""
        try:
            data = self.tq.kv_batch_get(keys=list(keys), partition_id=self.partition_id, select_fields=["rm_scores"])
        except ValueError:  # TransferQueue: "Some fields are not ready in all the requested keys!"
            return None
        return [float(v.sum().item()) for v in data["rm_scores"]]

    def clear(self, keys: Sequence[str]) -> None:
        if keys:
            self.tq.kv_clear(keys=list(keys), partition_id=self.partition_id)

    def put_prompt_tags(self, keys: Sequence[str], tags: Sequence[dict[str, Any]]) -> None:
        self.tq.kv_batch_put(keys=list(keys), partition_id=self.partition_id, tags=list(tags))

    def put_uids(self, keys: Sequence[str], uids: Sequence[str]) -> None:
        """Overwrite the stored ``uid`` field of trajectory keys (GRPO's group id)."""
        from tensordict import NonTensorStack, TensorDict

        self.tq.kv_batch_put(keys=list(keys), partition_id=self.partition_id,
                             fields=TensorDict({"uid": NonTensorStack(*uids)}, batch_size=[len(uids)]))

    def batch_meta(self, keys: Sequence[str], tags: Sequence[dict[str, Any]]) -> Any:
        from transfer_queue import KVBatchMeta

        return KVBatchMeta(partition_id=self.partition_id, keys=list(keys), tags=[dict(t) for t in tags])

    @staticmethod
    def launch_row(row: Any, uid: str, seeds: Sequence[int]) -> Any:
        """A copy of a one-row prompt TensorDict that runs ``len(seeds)`` sessions under ``uid``."""
        import torch
        from verl.utils import tensordict_utils as tu

        r = row.clone()
        tu.assign_non_tensor_stack(r, "uid", [uid])
        r["__rollout_n__"] = torch.tensor([len(seeds)], dtype=torch.int64)
        tu.assign_non_tensor_stack(r, SEEDS, [[int(s) for s in seeds]])
        return r

    @staticmethod
    def dataset_rows(trainer: Any, idx: np.ndarray) -> Any:
        """verl prompt rows for dataset positions ``idx`` (fresh uids, the trainer's ``global_steps``), as verl's
        dataloader would hand them over."""
        import uuid

        from verl.utils import tensordict_utils as tu
        from verl.utils.dataset.rl_dataset import collate_fn

        batch = collate_fn([trainer.train_dataset[int(i)] for i in idx])
        batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(idx))], dtype=object)
        td = tu.get_tensordict(batch)
        tu.assign_non_tensor_data(td, "global_steps", trainer.global_steps)
        return td
