"""Where the prompts of a verl step come from: verl's own dataloader (``refill_fn``) or a sara prompt sampler over
``trainer.train_dataset``. Both are sara ``PromptSampler`` s for ``sara.driver.collect``; the rows they take from
verl are offered to the step's ``VerlRolloutEnv`` by pool index.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from sara.integrations.verl_env import VerlRolloutEnv
from sara.integrations.verl_tq import pool_index_of
from sara.samplers.base import PromptSampler

__all__ = ["DatasetSource", "VerlDataloaderSource"]


class VerlDataloaderSource(PromptSampler):
    """Prompts in verl's own order: the rows ``prepare_step`` submitted, then ``refill_fn`` (verl's dataloader).

    Pool index = the row's ``index`` column (``extra_info.index`` in verl's datasets).

    Args:
        env: The step's environment (rows are offered to it).
        manager: The ``SaraAgentLoopManager`` (holds the rows verl submits).
        refill_fn: verl's ``trainer._add_prompts_to_generate``.
        gen_batch_size: verl's ``data.gen_batch_size`` (refills are rounded up to a multiple; extras wait for the next
            admission of the step).
        pool_size: Pool size reported to the driver.
    """

    name = "verl"

    def __init__(self, env: VerlRolloutEnv, manager: Any, refill_fn: Callable[[int], int], *, gen_batch_size: int,
                 pool_size: int) -> None:
        super().__init__(pool_size)
        self.env, self.manager, self.refill_fn, self.gen_batch_size = env, manager, refill_fn, max(1, gen_batch_size)
        self.rows: deque[tuple[str, Any]] = deque(manager.take_held())
        self.refills = 0

    def sample(self, m: int) -> np.ndarray:
        out: list[int] = []
        while len(out) < m:
            if not self.rows:
                need = math.ceil((m - len(out)) / self.gen_batch_size) * self.gen_batch_size
                self.refill_fn(need)
                self.refills += need
                self.rows.extend(self.manager.take_held())
                if not self.rows:
                    break
            uid, row = self.rows.popleft()
            p = pool_index_of(row)
            self.env.offer(p, uid, row)
            out.append(p)
        return np.asarray(out, np.int64)

    def leftover(self) -> list[str]:
        """Uids of rows taken from verl and never admitted (to be cleared)."""
        out = [uid for uid, _ in self.rows]
        self.rows.clear()
        return out


class DatasetSource(PromptSampler):
    """A sara prompt sampler choosing from verl's ``trainer.train_dataset`` (pool index = dataset position); the
    rows it picks enter verl through ``trainer._submit_batch_to_rollout``.

    Args:
        inner: The sara sampler (``make_sampler(spec, len(train_dataset), ...)``).
        env: The step's environment.
        manager: The ``SaraAgentLoopManager``.
        trainer: verl's trainer (``train_dataset``, ``global_steps``, ``_submit_batch_to_rollout``).
    """

    name = "dataset"

    def __init__(self, inner: PromptSampler, env: VerlRolloutEnv, manager: Any, trainer: Any) -> None:
        super().__init__(inner.pool_size, seed=inner.seed)
        self.inner, self.env, self.manager, self.trainer = inner, env, manager, trainer

    def sample(self, m: int) -> np.ndarray:
        idx = self.inner.sample(m)
        if len(idx):
            self.trainer._submit_batch_to_rollout(self.env.tq.dataset_rows(self.trainer, idx))
            held = self.manager.take_held()
            for p, (uid, row) in zip(idx.tolist(), held, strict=True):
                self.env.offer(p, uid, row)
        return idx

    def capacity(self) -> int | None:
        return self.inner.capacity()

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        self.inner.update(pool_index, n, rsum, step)
