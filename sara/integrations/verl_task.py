"""A ``sara`` task as verl's data and reward: its prompts as the parquet files verl's ``RLHFDataset`` reads, its
verifier as verl's custom reward function.

    python -m sara.integrations.verl_task my_module:make_task --out ~/data/my_task

writes ``train.parquet`` (``Task.prompts``) and ``test.parquet`` (``Task.eval_prompts``); bad input (an unknown task,
a ``--limit`` below 1, an ``--out`` that cannot be written, a task without prompts) is one line, ``sara: error: ...``,
exit status 2, as for ``sara``. Each row is
``data_source`` = ``"sara:" + the task spec``, ``prompt`` = the chat messages the task renders (a raw-text task's
prompt becomes one user message), ``reward_model.ground_truth`` = the prompt's answer fields as JSON and
``extra_info.index`` = the prompt's position in its split (sara's pool index, so per-prompt priors follow the prompt).
In verl's config::

    reward:
      custom_reward_function: {path: pkg://sara.integrations.verl_task, name: compute_score}

``compute_score`` rebuilds the task from the spec in ``data_source`` (once per process) and scores the completion
with its verifier under the task's time limit (``sara.envs.tasks.scoring.BatchScorer``; a verifier that is not
thread-safe runs in a worker process). The spec must build the task in verl's reward workers, which are other
processes: a ``module:factory`` entry point, or an id whose ``register_task`` call runs when its module is imported.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DATA_SOURCE_PREFIX", "compute_score", "task_rows", "write_parquet"]

DATA_SOURCE_PREFIX = "sara:"
"""``data_source`` of a row = this prefix + the task spec it came from."""

SPLITS = (("train", "train"), ("eval", "test"))
"""(the task's split, the parquet file's stem)."""


def task_rows(spec: str, split: str = "train", *, limit: int | None = None) -> list[dict[str, Any]]:
    """The prompts of ``split`` (``"train"`` or ``"eval"``) of the task ``spec`` as verl RL rows (module docstring).

    Args:
        spec: A task spec ``make_task`` accepts (``"sara/Arithmetic-v0:max_digits=2"``, ``"my_module:make_task"``).
        split: The task's split.
        limit: At most this many rows (the first ones), or all.

    Raises:
        ConfigError: ``make_task`` cannot build the task, ``limit`` is not a whole number >= 1, or a prompt's answer
            fields are not JSON-serializable.
    """
    from sara.config import ConfigError
    from sara.envs.tasks import make_task

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"verl_task: field 'limit': give a whole number of rows >= 1, or None for all (got {limit!r})")
    task = make_task(spec)
    prompts = task.split(split)[:limit]
    rows = []
    for i, p in enumerate(prompts):
        rendered = task.render(p)
        messages = [{"role": "user", "content": rendered}] if isinstance(rendered, str) else rendered
        try:
            truth = json.dumps(dict(p.answer), sort_keys=True)
        except TypeError as exc:
            raise ConfigError(f"task {spec!r}: prompt {p.id!r}: answer fields must be JSON values ({exc})") from None
        rows.append({"data_source": DATA_SOURCE_PREFIX + spec, "prompt": messages, "ability": "sara",
                     "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"split": split, "index": i, "prompt_id": str(p.id)}})
    return rows


def write_parquet(spec: str, out_dir: str | Path, *, limit: int | None = None) -> dict[str, Path]:
    """Write ``train.parquet`` and ``test.parquet`` of the task ``spec`` into ``out_dir`` (created); returns
    ``{split: path}``. A task without held-out prompts writes no ``test.parquet``.

    Raises:
        ConfigError: as ``task_rows``; the task has no prompts at all; ``out_dir`` or a file in it cannot be written
            (naming the path and why).
    """
    import pandas as pd

    from sara.config import ConfigError

    rows = {split: task_rows(spec, split, limit=limit) for split, _ in SPLITS}
    if not any(rows.values()):
        raise ConfigError(f"task {spec!r} has no prompts to write")
    out = Path(out_dir).expanduser()
    paths = {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for split, stem in SPLITS:
            if rows[split]:
                paths[split] = out / f"{stem}.parquet"
                pd.DataFrame(rows[split]).to_parquet(paths[split])
    except OSError as exc:
        raise ConfigError(f"--out {str(out)!r} cannot be written: {exc.strerror or exc}; give a writable "
                          "directory") from None
    return paths


@functools.lru_cache(maxsize=16)
def _scorer(spec: str) -> Any:
    from sara.envs.tasks import make_task
    from sara.envs.tasks.scoring import BatchScorer, scorer_mode

    task = make_task(spec)
    return BatchScorer(task.verifier, mode=scorer_mode("auto", task), timeout_s=task.timeout_s)


_LOCK = threading.Lock()  # verl calls the reward function from an executor's threads; one scorer per task


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, *,
                  task: str | None = None, **_: Any) -> float:
    """verl's custom reward function: the task's verifier on ``solution_str`` (0.0 where it raises, times out or
    returns None).

    Args:
        data_source: ``"sara:" + spec`` (what ``task_rows`` writes).
        solution_str: The decoded completion.
        ground_truth: The answer fields as JSON.
        extra_info: verl's extras of the row (unused).
        task: The task spec, overriding ``data_source`` (verl's ``custom_reward_function.reward_kwargs``).

    Raises:
        ValueError: Neither ``task`` nor a ``data_source`` written by ``task_rows`` names the task.
    """
    spec = task or (data_source[len(DATA_SOURCE_PREFIX):] if data_source.startswith(DATA_SOURCE_PREFIX) else "")
    if not spec:
        raise ValueError(f"sara.integrations.verl_task.compute_score: data_source {data_source[:80]!r} does not start "
                         f"with {DATA_SOURCE_PREFIX!r}; write the rows with task_rows / write_parquet, or pass "
                         "reward_kwargs: {task: SPEC}")
    answer = json.loads(ground_truth)
    with _LOCK:
        result = _scorer(spec).score([solution_str], [answer])
    return float(result.rewards[0])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sara.integrations.verl_task",
                                 description="Write a sara task's prompts as verl's train.parquet / test.parquet.")
    ap.add_argument("task", help="task spec: a registered id with options or module:factory")
    ap.add_argument("--out", required=True, help="directory of the parquet files (created)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many rows per split (>= 1)")
    args = ap.parse_args(argv)
    from sara.cli import MAX_ERROR_CHARS
    from sara.config import SaraError
    from sara.registry import clip

    try:
        paths = write_parquet(args.task, args.out, limit=args.limit)
    except SaraError as exc:
        print(f"sara: error: {clip(str(exc), MAX_ERROR_CHARS)}", file=sys.stderr)
        return 2
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
