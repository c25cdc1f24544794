"""Gymnasium registration of every sara task: ``import sara.envs.gym`` then ``gymnasium.make("sara/Countdown-v0")``.

Each task becomes a single-step text environment: ``reset`` draws a prompt (observation: its rendered text),
``step(completion)`` scores the completion with the task's verifier (reward) and ends the episode. Options of
``gymnasium.make`` go to the task factory (``gymnasium.make("sara/Arithmetic-v0", max_digits=2)``), except
``split`` (``"train"`` / ``"eval"``). Tasks registered after the import are added with ``register_gym_envs()``.

This is the only module of sara that imports gymnasium.
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium
from gymnasium import spaces

from sara.envs.tasks import TASKS, Task, make_task
from sara.envs.tasks.scoring import OK, BatchScorer, scorer_mode
from sara.types import Prompt

__all__ = ["TextTaskEnv", "register_gym_envs", "observation_text"]

ACTION_CHARSET = string.printable
"""Characters of sampled actions (``action_space.sample()``); ``step`` accepts any string."""
MAX_ACTION_CHARS = 4096


def observation_text(task: Task, prompt: Prompt) -> str:
    """The observation for a prompt: the rendered text, or the chat messages' contents joined by blank lines."""
    rendered = task.render(prompt)
    if isinstance(rendered, str):
        return rendered
    return "\n\n".join(m["content"] for m in rendered)


class TextTaskEnv(gymnasium.Env):
    """A sara task as a single-step gymnasium environment.

    Args:
        task_id: A registered task id (or ``"module:attr"``); ignored when ``task`` is given.
        task: A ``Task`` object.
        split: ``"train"`` or ``"eval"`` prompts.
        **task_options: Options for the task factory.

    ``reset(options={"index": i})`` picks prompt ``i``; otherwise the prompt is drawn with the env's seeded RNG.
    ``info`` holds ``prompt_id``, ``pool_index``, ``messages`` (chat tasks) and, after ``step``, ``verifier``
    (``"ok"``, or why the reward is 0: ``"error"``, ``"timeout"``, ``"not_applicable"``).
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, task_id: str | None = None, *, task: Task | None = None, split: str = "train",
                 **task_options: Any) -> None:
        if task is None:
            if task_id is None:
                raise ValueError("TextTaskEnv: give task_id or task")
            task = make_task(task_id, **task_options)
        self.task = task
        self.prompts = task.split(split)
        if not self.prompts:
            raise ValueError(f"TextTaskEnv: task {task.id!r} has no {split!r} prompts")
        texts = [observation_text(task, p) for p in self.prompts]
        charset = frozenset(string.printable).union(*map(frozenset, texts))
        self.observation_space = spaces.Text(max_length=max(map(len, texts)), min_length=0, charset=charset)
        self.action_space = spaces.Text(max_length=MAX_ACTION_CHARS, min_length=0, charset=ACTION_CHARSET)
        # a watched thread for verifiers that bound their own work, worker processes (time and memory limits) else
        self._scorer = BatchScorer(task.verifier, mode=scorer_mode("auto", task), timeout_s=task.timeout_s, workers=1)
        self._index: int | None = None
        self._obs = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        if options and "index" in options:
            index = int(options["index"])
            if not 0 <= index < len(self.prompts):
                raise IndexError(f"prompt index {index} out of range [0, {len(self.prompts)})")
        else:
            index = int(self.np_random.integers(len(self.prompts)))
        self._index = index
        prompt = self.prompts[index]
        self._obs = observation_text(self.task, prompt)
        return self._obs, self._info(prompt)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self._index is None:
            raise RuntimeError("call reset() before step()")
        prompt = self.prompts[self._index]
        completion = action if isinstance(action, str) else ""
        scored = self._scorer.score([completion], [prompt.answer])
        status = int(scored.status[0])
        info = self._info(prompt)
        info["verifier"] = "ok" if status == OK else ["ok", "not_applicable", "error", "timeout"][status]
        self._index = None
        return self._obs, float(scored.rewards[0]), True, False, info

    def _info(self, prompt: Prompt) -> dict[str, Any]:
        info: dict[str, Any] = {"prompt_id": prompt.id, "pool_index": self._index}
        rendered = self.task.render(prompt)
        if not isinstance(rendered, str):
            info["messages"] = rendered
        return info

    def close(self) -> None:
        self._scorer.close()


def register_gym_envs() -> list[str]:
    """Register every task of ``TASKS`` with gymnasium (idempotent); returns the ids registered now."""
    added = []
    for task_id in TASKS.names():
        if task_id in gymnasium.registry:
            continue
        gymnasium.register(id=task_id, entry_point="sara.envs.gym:TextTaskEnv", kwargs={"task_id": task_id})
        added.append(task_id)
    return added


register_gym_envs()
