"""How saturated a prompt pool is for a policy: ``pool_outcomes`` samples k completions of every prompt and counts
the groups that are all right (solved), all wrong (unsolved) or mixed, overall and per mixture component.

Only mixed groups carry a GRPO gradient, so the mixed fraction is what rollout allocation is about: a pool where most
k-groups are saturated is the regime where DS and SARA differ from uniform sampling. Seeded: the same policy, task,
``k`` and ``seed`` give the same counts.

Example:
    >>> from sara.bench.pool import pool_outcomes               # doctest: +SKIP
    >>> with Trainer(TrainConfig()) as t:                       # doctest: +SKIP
    ...     print(pool_outcomes(t.policy, t.task, k=8, seed=0).table())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["PoolOutcomes", "pool_outcomes"]


@dataclass(frozen=True)
class PoolOutcomes:
    """Fractions of k-groups by outcome.

    Attributes:
        k: Completions per prompt.
        prompts: Prompts sampled.
        solved: Share of prompts whose k completions are all correct.
        unsolved: Share with no correct completion.
        mixed: Share with some correct and some wrong (the groups with a GRPO gradient).
        accuracy: Mean reward over every completion.
        by_component: The same numbers per ``Prompt.metadata["component"]`` (mixture tasks), label -> fields.
    """

    k: int
    prompts: int
    solved: float
    unsolved: float
    mixed: float
    accuracy: float
    by_component: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def saturated(self) -> float:
        """Share of prompts whose k-group is all correct or all wrong (no GRPO gradient)."""
        return self.solved + self.unsolved

    def table(self) -> str:
        """A markdown table: one row per component (if any) and the whole pool."""
        rows = [*self.by_component.items(), ("all", {"prompts": self.prompts, "solved": self.solved,
                                                     "unsolved": self.unsolved, "mixed": self.mixed,
                                                     "accuracy": self.accuracy})]
        lines = [f"| component | prompts | solved (all {self.k} right) | unsolved (none right) | mixed | accuracy |",
                 "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {name} | {int(r['prompts'])} | {r['solved']:.1%} | {r['unsolved']:.1%} | {r['mixed']:.1%} | "
                  f"{r['accuracy']:.1%} |" for name, r in rows]
        return "\n".join(lines)


def _fractions(rewards: np.ndarray, threshold: float) -> dict[str, float]:
    hits = (rewards >= threshold).sum(1)
    k = rewards.shape[1]
    return {"prompts": float(len(rewards)), "solved": float((hits == k).mean()), "unsolved": float((hits == 0).mean()),
            "mixed": float(((hits > 0) & (hits < k)).mean()), "accuracy": float(rewards.mean())}


def pool_outcomes(policy: Any, task: Any, k: int = 8, seed: int = 0, *, backend: Any = "tiny",
                  backend_options: Mapping[str, Any] | None = None, split: str = "train",
                  max_prompts: int | None = None, temperature: float = 1.0, threshold: float = 1.0,
                  chunk_prompts: int = 512) -> PoolOutcomes:
    """Sample ``k`` completions of each prompt of a task split and count solved / unsolved / mixed groups.

    Args:
        policy: The policy (e.g. ``Trainer.policy``); ignored when ``backend`` is a backend object.
        task: A ``Task`` or a task spec for ``make_task``.
        k: Completions per prompt (the group size).
        seed: Seed of the completions (rollout ``j`` of prompt ``i`` always gets the same seed).
        backend: A backend name in ``sara.backends.BACKENDS`` (built on ``policy``) or a backend object.
        backend_options: Options for a backend built by name.
        split: ``"train"`` (the pool) or ``"eval"``.
        max_prompts: Only the first this many prompts (None = all).
        temperature: Sampling temperature (1.0 = the training default).
        threshold: A completion counts as correct when its reward is at least this.
        chunk_prompts: Prompts per backend call.

    Returns:
        The fractions, overall and per ``Prompt.metadata["component"]``.
    """
    from sara.backends import BACKENDS
    from sara.envs.base import SamplingConfig
    from sara.envs.task_env import TaskEnv
    from sara.envs.tasks import make_task
    from sara.seeding import derive_seeds
    from sara.types import RolloutRequest

    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    task = make_task(task) if isinstance(task, str) else task
    engine = BACKENDS.get(backend)(policy, dict(backend_options or {}), task=task, seed=seed) \
        if isinstance(backend, str) else backend
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=task.max_new_tokens or 64, stop=task.stop)
    env = TaskEnv(task, engine, sampling, split=split, scorer_mode="inline")  # type: ignore[arg-type]
    prompts = list(env.prompts[:max_prompts])
    seeds = derive_seeds(seed, 0x9001, np.arange(len(prompts))[:, None], np.arange(k)[None])
    rewards = np.zeros((len(prompts), k))
    for lo in range(0, len(prompts), chunk_prompts):
        reqs = [RolloutRequest(unit_id=i, pool_index=i, prompt=prompts[i], seeds=tuple(int(s) for s in seeds[i]))
                for i in range(lo, min(lo + chunk_prompts, len(prompts)))]
        for req, rollouts in zip(reqs, env.rollout(reqs)):
            rewards[req.pool_index] = [r.reward for r in rollouts]
    labels = np.asarray([str(p.metadata.get("component", "")) for p in prompts], dtype=object)
    by_component = {str(c): _fractions(rewards[labels == c], threshold) for c in dict.fromkeys(labels) if c}
    whole = _fractions(rewards, threshold)
    return PoolOutcomes(k=k, prompts=len(prompts), solved=whole["solved"], unsolved=whole["unsolved"],
                        mixed=whole["mixed"], accuracy=whole["accuracy"], by_component=by_component)
