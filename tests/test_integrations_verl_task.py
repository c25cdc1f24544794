"""A sara task of one's own as verl's data and reward (``sara.integrations.verl_task``): the rows and the reward
function run everywhere; that verl's ``RLHFDataset`` reads the parquet files and verl's config loads the reward
function runs in verl's environment (``bash .ci/verl``) and is skipped elsewhere."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from sara.envs.tasks import Task, register_task
from sara.integrations.verl_task import DATA_SOURCE_PREFIX, compute_score, main, task_rows, write_parquet
from sara.types import Prompt

WORDS = ["apple", "brick", "cloud", "delta", "ember", "frost", "grape", "honey", "ivory", "jelly"]


def verify(completion: str, *, word: str) -> float | None:
    if completion.startswith("PASS"):
        return None  # "not applicable": scored 0
    if completion.startswith("BOOM"):
        raise RuntimeError("a verifier that raises: scored 0")
    return float(completion[:32].strip() == word.upper())


def make_upper_task(size: int | str = 8) -> Task:
    """A user's task: upper-case a word (a chat task, answer field ``word``)."""
    prompts = [Prompt(id=f"up-{w}", prompt=f"Upper-case '{w}'.", answer={"word": w}) for w in WORDS]
    return Task(id="tests/Upper-v0", prompts=prompts[:int(size)], eval_prompts=prompts[int(size):], verifier=verify, chat=True,
                system_prompt="Answer with the word only.")


SPEC = "test_integrations_verl_task:make_upper_task"  # a module:factory entry point, importable by verl's workers


def test_rows_carry_the_prompt_the_answer_and_the_task():
    rows = task_rows(SPEC, "train")
    assert len(rows) == 8 and [r["extra_info"]["index"] for r in rows] == list(range(8))
    row = rows[3]
    assert row["data_source"] == DATA_SOURCE_PREFIX + SPEC
    assert row["prompt"] == [{"role": "system", "content": "Answer with the word only."},
                             {"role": "user", "content": "Upper-case 'delta'."}]
    assert json.loads(row["reward_model"]["ground_truth"]) == {"word": "delta"}
    assert row["extra_info"]["prompt_id"] == "up-delta" and row["extra_info"]["split"] == "train"
    held_out = task_rows(SPEC, "eval")
    assert [r["extra_info"]["prompt_id"] for r in held_out] == ["up-ivory", "up-jelly"]


def test_a_raw_text_task_becomes_one_user_message_of_its_rendered_prompt():
    from sara.envs.tasks import make_task

    spec = "sara/Arithmetic-v0:pool_size=20,eval_size=5"
    task = make_task(spec)
    rows = task_rows(spec, limit=3)
    assert len(rows) == 3
    assert rows[0]["prompt"] == [{"role": "user", "content": task.render(task.prompts[0])}]
    answer = json.loads(rows[0]["reward_model"]["ground_truth"])
    assert answer == dict(task.prompts[0].answer)


def test_compute_score_is_the_tasks_verifier():
    row = task_rows(SPEC)[0]
    score = lambda text, **kw: compute_score(row["data_source"], text, row["reward_model"]["ground_truth"],  # noqa: E731
                                             row["extra_info"], **kw)
    assert score("APPLE") == 1.0
    assert score(" APPLE \n") == 1.0
    assert score("apple") == 0.0
    assert score("PASS") == 0.0 and score("BOOM") == 0.0  # None and a raising verifier score 0, no exception
    # reward_kwargs' task wins over data_source
    assert compute_score("openai/gsm8k", "APPLE", row["reward_model"]["ground_truth"], task=SPEC) == 1.0


def test_a_registered_id_works_where_the_registration_is_imported():
    register_task("tests/Upper-v0", make_upper_task, override=True)
    row = task_rows("tests/Upper-v0:size=5")[4]
    assert row["data_source"] == "sara:tests/Upper-v0:size=5"
    assert compute_score(row["data_source"], "EMBER", row["reward_model"]["ground_truth"]) == 1.0


def test_a_foreign_data_source_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="reward_kwargs"):
        compute_score("openai/gsm8k", "13", '{"word": "x"}')


def test_parquet_files_round_trip(tmp_path, capsys):
    assert main([SPEC, "--out", str(tmp_path / "data")]) == 0
    assert "train:" in capsys.readouterr().out
    train = pd.read_parquet(tmp_path / "data" / "train.parquet")
    test = pd.read_parquet(tmp_path / "data" / "test.parquet")
    assert len(train) == 8 and len(test) == 2
    first = train.iloc[0]
    assert compute_score(first["data_source"], "APPLE", first["reward_model"]["ground_truth"]) == 1.0
    only_train = write_parquet(f"{SPEC.split(':')[0]}:make_upper_task", tmp_path / "limited", limit=2)
    assert len(pd.read_parquet(only_train["train"])) == 2


def test_verl_reads_the_rows_and_loads_the_reward_function(tmp_path):
    pytest.importorskip("verl.trainer.ppo.v1.replay_buffer", reason="needs verl 0.9.1 (bash .ci/verl)")
    from test_integrations_verl_harness import compose
    from test_integrations_verl_recipe import tiny_tokenizer
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.trainer.ppo.utils import create_rl_dataset

    paths = write_parquet(SPEC, tmp_path)
    cfg = compose(items=[f"data.train_files={paths['train']}", f"data.val_files={paths['eval']}",
                         "reward.custom_reward_function.path=pkg://sara.integrations.verl_task",
                         "reward.custom_reward_function.name=compute_score"])
    ds = create_rl_dataset(cfg.data.train_files, cfg.data, tiny_tokenizer(), None, is_train=True)
    assert len(ds) == 8
    row = ds[2]
    assert row["index"] == 2 and row["raw_prompt"][-1]["content"] == "Upper-case 'cloud'."
    reward_fn = get_custom_reward_fn(cfg)
    # the keywords verl's NaiveRewardManager.run_single passes
    kw = dict(data_source=row["data_source"], ground_truth=row["reward_model"]["ground_truth"],
              extra_info={**row["extra_info"], "num_turns": 2, "rollout_reward_scores": {}})
    assert reward_fn(solution_str="CLOUD", **kw) == 1.0
    assert reward_fn(solution_str="CLOUDS", **kw) == 0.0
