"""reward_fn / task_dataset: sara verifiers as TRL reward functions, called the way TRL's GRPOTrainer calls them."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]')")

from sara.envs.tasks import make_task  # noqa: E402
from sara.integrations.trl_rewards import TASK_COLUMN, reward_fn, task_dataset  # noqa: E402

COUNTDOWN = "sara/Countdown-v0"


def as_completion(prompt, text):
    return text if isinstance(prompt, str) else [{"role": "assistant", "content": text}]


def rows_and_completions(n=4):
    task = make_task(COUNTDOWN)
    ds = task_dataset(task)
    rows = [ds[i] for i in range(n)]
    good = [f"<answer> {p.metadata['solution']} </answer>" for p in task.prompts[:n]]
    return task, rows, good


def columns(rows):
    return {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}


def test_dataset_has_prompt_answer_fields_and_task_id():
    task, rows, _ = rows_and_completions(2)
    assert set(rows[0]) == {"prompt", "numbers", "target", TASK_COLUMN}
    assert rows[0]["prompt"] == task.render(task.prompts[0])
    assert rows[0]["numbers"] == list(task.prompts[0].answer["numbers"]) and rows[0][TASK_COLUMN] == COUNTDOWN


def test_scores_like_the_verifier_with_none_for_other_tasks_rows():
    task, rows, good = rows_and_completions(4)
    fn = reward_fn(COUNTDOWN)
    prompts = [r["prompt"] for r in rows]
    completions = [as_completion(p, c) for p, c in zip(prompts, [good[0], "<answer> 1 + 1 </answer>", good[2], "x"])]
    cols = columns(rows)
    cols[TASK_COLUMN][3] = "sara/GSM8K-v0"  # a mixed-task dataset: this row is not Countdown's
    out = fn(prompts=prompts, completions=completions, completion_ids=[[1]] * 4, **cols)
    assert out == [1.0, 0.0, 1.0, None]
    # renamed columns (e.g. Countdown-Tasks-3to4's "nums") and a missing answer field -> None
    cols["nums"] = cols.pop("numbers")
    assert reward_fn(COUNTDOWN, columns={"numbers": "nums"})(prompts, completions, **cols)[:3] == [1.0, 0.0, 1.0]
    assert fn(prompts, completions, **cols) == [None] * 4
    with pytest.raises(ValueError, match="unknown answer fields"):
        reward_fn(COUNTDOWN, columns={"nums": "numbers"})
    # adversarial output scores 0, never raises; the callable pickles (TRL's async worker spawns a process)
    assert fn(prompts[:1], [as_completion(prompts[0], "<answer> 9**9**9**9 </answer>")], **columns(rows[:1])) == [0.0]
    clone = pickle.loads(pickle.dumps(fn))
    assert clone(prompts=prompts[:1], completions=completions[:1], **columns(rows[:1])) == [1.0]
    assert fn.__name__ == "sara_sara_Countdown_v0"
    fn.close()
    clone.close()


def test_grpo_trainer_calls_it_with_its_own_convention(tiny_model_dir, tmp_path):
    """TRL's own GRPOTrainer._calculate_rewards (dataset columns + trainer_state, log_extra, log_metric) and one real
    training step of GRPOTrainer with the reward function."""
    from trl import GRPOConfig, GRPOTrainer

    task, rows, good = rows_and_completions(4)
    fn = reward_fn(COUNTDOWN)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, max_steps=1, report_to="none", logging_steps=1,
                      save_strategy="no")
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=[fn], args=args,
                          train_dataset=task_dataset(task).select(range(16)))
    prompts = [r["prompt"] for r in rows]
    completions = [as_completion(p, c) for p, c in zip(prompts, [good[0], "no", good[2], good[3]])]
    rows[3] = {**rows[3], TASK_COLUMN: "other/Task-v0"}
    rewards = trainer._calculate_rewards(rows, prompts, completions, [[0]] * 4)
    assert rewards[:3, 0].tolist() == [1.0, 0.0, 1.0] and rewards[3, 0].isnan()  # None -> NaN, TRL's convention
    trainer.train()
    logged = {k for rec in trainer.state.log_history for k in rec}
    assert f"rewards/{fn.__name__}/mean" in logged
    fn.close()
