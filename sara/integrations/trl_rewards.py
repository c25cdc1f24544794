"""``sara`` tasks as TRL datasets and reward functions (``GRPOTrainer``, ``AsyncGRPOTrainer``'s default worker).

TRL calls a reward function as ``fn(prompts=..., completions=..., completion_ids=..., **columns)`` where ``columns``
holds every other dataset column, one value per completion (plus ``trainer_state``, ``log_extra``, ``log_metric``
from ``GRPOTrainer``), and accepts ``None`` for a completion the function does not apply to. ``reward_fn(task)``
maps those columns to the task verifier's answer fields (same names by default, ``columns={"numbers": "nums"}`` to
rename) and scores with the same ``BatchScorer`` as ``TaskEnv``: a verifier that raises or runs past its time limit
gives 0, and ``None`` is returned where the row is another task's (its ``sara_task`` column names another id, or an
answer field is missing) or the verifier says "not applicable".

``task_dataset(task)`` is the matching ``datasets.Dataset``: a ``prompt`` column (text, or chat messages for chat
tasks) plus one column per answer field and ``sara_task``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sara.envs.tasks import Task, make_task
from sara.envs.tasks.scoring import NOT_APPLICABLE, OK, BatchScorer

__all__ = ["TaskReward", "reward_fn", "task_dataset", "TASK_COLUMN"]

TASK_COLUMN = "sara_task"
"""Dataset column naming the task id of each row (``task_dataset`` writes it; mixed-task datasets route on it)."""


def _task(task: Task | str) -> Task:
    return make_task(task) if isinstance(task, str) else task


def answer_fields(task: Task) -> tuple[str, ...]:
    """The verifier's answer fields, in first-seen order over the task's prompts."""
    seen: dict[str, None] = {}
    for p in (*task.prompts, *task.eval_prompts):
        seen.update(dict.fromkeys(p.answer))
    return tuple(seen)


def task_dataset(task: Task | str, split: str = "train") -> Any:
    """A ``datasets.Dataset`` of a task's prompts: ``prompt`` (rendered as the model should see it: text, or chat
    messages for chat tasks), the answer fields, and ``sara_task`` (the task id)."""
    from datasets import Dataset

    t = _task(task)
    rows = [{"prompt": t.render(p), **dict(p.answer), TASK_COLUMN: t.id} for p in t.split(split)]
    return Dataset.from_list(rows)


def _text(completion: Any) -> str:
    """A TRL completion as text: a string, or the concatenated contents of its (assistant) messages."""
    if isinstance(completion, str):
        return completion
    parts = []
    for m in completion:
        content = m.get("content", "") if isinstance(m, Mapping) else str(m)
        parts.append(content if isinstance(content, str) else "".join(
            c.get("text", "") for c in content if isinstance(c, Mapping)))
    return "".join(parts)


class TaskReward:
    """A picklable TRL reward callable for one ``sara`` task (see the module docstring).

    Args:
        task: A ``Task`` or task id / spec (``"sara/Countdown-v0"``).
        columns: Answer field -> dataset column, for fields whose column is named differently.
        mode: ``BatchScorer`` mode: ``"thread"`` (default for thread-safe verifiers), ``"process"`` (default
            otherwise), ``"inline"``.
        timeout_s: Per-call verifier time limit (default: the task's).
    """

    def __init__(self, task: Task | str, *, columns: Mapping[str, str] | None = None, mode: str | None = None,
                 timeout_s: float | None = None) -> None:
        self.task = _task(task)
        self.fields = answer_fields(self.task)
        self.columns = {f: (columns or {}).get(f, f) for f in self.fields}
        unknown = set(columns or {}) - set(self.fields)
        if unknown:
            raise ValueError(f"reward_fn({self.task.id!r}): columns names unknown answer fields {sorted(unknown)}; "
                             f"the verifier's fields are {list(self.fields)}")
        self.mode = mode or ("thread" if self.task.thread_safe else "process")
        self.timeout_s = timeout_s or self.task.timeout_s
        self.__name__ = "sara_" + "".join(c if c.isalnum() else "_" for c in self.task.id)
        self._scorer: BatchScorer | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_scorer": None}  # scorer threads / processes are per process

    def __call__(self, prompts: Sequence[Any] | None = None, completions: Sequence[Any] = (),
                 **kwargs: Any) -> list[float | None]:
        n = len(completions)
        ids = kwargs.get(TASK_COLUMN)
        rows: list[int] = []
        answers: list[dict[str, Any]] = []
        for i in range(n):
            if ids is not None and ids[i] is not None and ids[i] != self.task.id:
                continue
            answer = {}
            for field, col in self.columns.items():
                values = kwargs.get(col)
                if values is None or values[i] is None:
                    break
                answer[field] = values[i]
            else:
                rows.append(i)
                answers.append(answer)
        out: list[float | None] = [None] * n
        if rows:
            if self._scorer is None:
                self._scorer = BatchScorer(self.task.verifier, mode=self.mode, timeout_s=self.timeout_s)
            scored = self._scorer.score([_text(completions[i]) for i in rows], answers)
            for j, i in enumerate(rows):
                status = int(scored.status[j])
                out[i] = None if status == NOT_APPLICABLE else float(scored.rewards[j]) if status == OK else 0.0
        return out

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None


def reward_fn(task: Task | str, **options: Any) -> TaskReward:
    """``TaskReward(task, **options)``: a task's verifier as a TRL reward function."""
    return TaskReward(task, **options)
