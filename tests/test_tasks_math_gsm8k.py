"""GSM8K (strict / flexible), MATH (math-verify behind guards), AIME (integers), data loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sara.config import ConfigError
from sara.envs.base import Completion
from sara.envs.task_env import TaskEnv
from sara.envs.tasks import gsm8k, make_task, math
from sara.types import RolloutRequest


class EchoBackend:
    """Returns ``texts[seed]`` for each seed (a fake GenerationBackend)."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def generate(self, requests, sampling):  # type: ignore[no-untyped-def]
        return [[Completion(text=self.texts[s], token_ids=(1, 2), logprobs=(-0.1, -0.2), seed=s) for s in r.seeds]
                for r in requests]

    def update_weights(self, state_dict, version):  # type: ignore[no-untyped-def]
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("completion", "gold", "strict", "flexible"), [
    ("She has 14 apples.\n#### 14", "14", 1.0, 1.0),
    ("#### $1,234", "1234", 1.0, 1.0),
    ("#### 1,234 dollars", "1,234", 1.0, 1.0),
    ("#### 18.00", "18", 1.0, 1.0),
    ("#### -7 degrees", "-7", 1.0, 1.0),
    ("#### 7", "-7", 0.0, 0.0),
    ("The answer is 14.", "14", 0.0, 1.0),  # flexible: last number
    ("#### 13\nWait, it is 14", "14", 0.0, 1.0),
    ("#### 14\nso 13 remain", "14", 1.0, 0.0),
    ("#### 12 #### 14", "14", 1.0, 1.0),  # the last ####
    ("####", "14", 0.0, 0.0),
    ("#### fourteen", "14", 0.0, 0.0),
    ("#### \u0661\u0664", "14", 0.0, 0.0),  # Arabic-Indic digits
    ("#### 1.4e1", "14", 0.0, 0.0),
    ("#### 3.5", "3.5", 1.0, 1.0),
    ("#### 7/2", "3.5", 0.0, 0.0),
])
def test_gsm8k_verify(completion: str, gold: str, strict: float, flexible: float) -> None:
    assert gsm8k.verify(completion, answer=gold) == strict
    assert gsm8k.verify(completion, answer=gold, mode="flexible") == flexible


def test_gsm8k_limits() -> None:
    assert gsm8k.verify("#### 14" + " " * 10_000, answer="14") == 1.0  # the whole completion is read
    assert gsm8k.parse_number("1" * (gsm8k.MAX_NUMBER_CHARS + 1)) is None
    assert gsm8k.verify("#### 14", answer="not a number") == 0.0


def test_gsm8k_task_and_modes() -> None:
    task = make_task("sara/GSM8K-v0")
    assert len(task.prompts) == 12 and task.eval_prompts == []
    for p in task.prompts:
        assert task.score(str(p.metadata["solution"]), p) == 1.0
        assert "####" in task.render(p)[-1]["content"]  # type: ignore[index]
    flexible = make_task("sara/GSM8K-v0", mode="flexible", chat=False, eval_size=3)
    assert len(flexible.prompts) == 9 and len(flexible.eval_prompts) == 3
    assert flexible.score("It is 14", flexible.prompts[0]) == 1.0
    assert isinstance(flexible.render(flexible.prompts[0]), str)
    with pytest.raises(ConfigError, match="mode"):
        make_task("sara/GSM8K-v0", mode="loose")


@pytest.mark.parametrize(("pred", "gold", "expected"), [
    (r"\frac{3}{4}", r"\frac{3}{4}", 1.0),
    ("0.75", r"\frac{3}{4}", 1.0),
    ("3/4", r"\frac{3}{4}", 1.0),
    (r"\dfrac34", r"\frac{3}{4}", 1.0),
    (r"\frac{4}{3}", r"\frac{3}{4}", 0.0),
    (r"8\sqrt{2}", r"8\sqrt{2}", 1.0),
    (r"\sqrt{128}", r"8\sqrt{2}", 1.0),
    (r"14\pi", r"14\pi", 1.0),
    (r"(3, \infty)", r"(3, \infty)", 1.0),
    (r"[3, \infty)", r"(3, \infty)", 0.0),
    ("5 + i", "5 + i", 1.0),
    ("i + 5", "5 + i", 1.0),
    ("-6", "-6", 1.0),
    ("6", "-6", 0.0),
    (r"x = 8", "8", 1.0),
])
def test_math_verify_equivalence(pred: str, gold: str, expected: float) -> None:
    assert math.verify(f"Thus the answer is $\\boxed{{{pred}}}$.", answer=gold) == expected


def test_math_boxed_extraction_and_guards() -> None:
    assert math.last_boxed(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert math.last_boxed(r"\fbox{7}") == "7" and math.last_boxed(r"\boxed 7$") == "7"
    assert math.last_boxed(r"\boxed{" + "{" * (math.MAX_BRACE_DEPTH + 1)) is None
    assert math.last_boxed(r"\boxed{" + "1" * (math.MAX_BOXED_CHARS + 5) + "}") is None
    assert math.last_boxed("no box") is None and math.last_boxed(r"\boxed{1") is None
    for unsafe in ["9^{9^{9}}", "9^9^9", "9**9**9", "10^{100000}", "100000!", r"\int_0^1 x dx", r"\sum_{k=1}^{n} k",
                   "(" * 20 + "1" + ")" * 20, "1" * 100, "1\x00"]:
        assert not math.safe_for_sympy(unsafe), unsafe
    for safe in ["x^2+y^2", r"\frac{1}{2}", "2^{10}", "5!", r"e^{i\pi}", r"(3, \infty)"]:
        assert math.safe_for_sympy(safe), safe
    assert math.verify(r"\boxed{9^{9^{9^{9}}}}", answer="1") == 0.0


@pytest.mark.parametrize(("completion", "expected"), [
    (r"\boxed{33}", 1.0), (r"\boxed{033}", 1.0), (r"\boxed{ 33 }", 1.0), (r"\boxed{$33$}", 1.0),
    (r"\boxed{33.0}", 0.0), (r"\boxed{34}", 0.0), (r"\boxed{3 3}", 0.0), ("33", 0.0),
    (r"\boxed{\text{33}}", 0.0), (r"\boxed{" + "3" * 20 + "}", 0.0),
])
def test_aime_verify_integer(completion: str, expected: float) -> None:
    assert math.verify_integer(completion, answer=33) == expected


def test_bundled_math_and_aime_tasks() -> None:
    m = make_task("sara/MATH-v0", eval_size=6)
    assert len(m.prompts) == 30 and len(m.eval_prompts) == 6 and not m.thread_safe
    assert all(m.score(f"\\boxed{{{p.answer['answer']}}}", p) == 1.0 for p in [*m.prompts, *m.eval_prompts])
    assert r"\boxed{}" in m.render(m.prompts[0])[-1]["content"]  # type: ignore[index]
    aime = make_task("sara/AIME-v0")
    assert aime.thread_safe and all(isinstance(p.answer["answer"], int) for p in aime.prompts)
    assert all(0 <= p.answer["answer"] <= 999 for p in aime.prompts)


def test_local_files(tmp_path: Path) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(r) for r in [
        {"problem": "What is 1+1?", "solution": "It is $\\boxed{2}$."},
        {"problem": "What is half of 1?", "answer": "\\frac12", "level": 1},
        {"question": "2*3?", "answer": "6"},
    ]) + "\n\n")
    held = tmp_path / "eval.json"
    held.write_text(json.dumps([{"problem": "1+2?", "answer": "3"}]))
    task = make_task("sara/MATH-v0", path=str(train), eval_path=str(held))
    assert [p.answer["answer"] for p in task.prompts] == ["2", "\\frac12", "6"]
    assert task.prompts[1].metadata["level"] == 1 and len(task.eval_prompts) == 1
    assert len(make_task("sara/MATH-v0", path=str(train), max_prompts=2).prompts) == 2
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "q", "answer": "so\n#### 1,000"}) + "\n")
    assert make_task("sara/GSM8K-v0", path=str(gsm)).prompts[0].answer == {"answer": "1000"}


@pytest.mark.parametrize(("options", "match"), [
    ({"path": "/nonexistent.jsonl"}, "does not exist"),
    ({"path": "data.csv"}, "does not exist"),
    ({"eval_size": 36}, "eval_size"),
    ({"path": "x.jsonl", "hf_dataset": "y"}, "not both"),
    ({"pathh": "x"}, "unknown option"),
])
def test_data_errors(options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_task("sara/MATH-v0", **options)


@pytest.mark.parametrize(("task_id", "line", "match"), [
    ("sara/MATH-v0", '{"problem": "x"}', "record 0"),
    ("sara/MATH-v0", "{not json", "invalid JSON"),
    ("sara/AIME-v0", '{"problem": "x", "answer": "1.5"}', "integers"),
    ("sara/GSM8K-v0", '{"question": "x", "answer": "no number"}', "####"),
])
def test_bad_records(tmp_path: Path, task_id: str, line: str, match: str) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    with pytest.raises(ConfigError, match=match):
        make_task(task_id, path=str(bad))


def test_unreadable_parquet(tmp_path: Path) -> None:
    pq = tmp_path / "d.parquet"
    pq.write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="pyarrow"):
            make_task("sara/MATH-v0", path=str(pq))


def test_hf_dataset_is_offline_only() -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="datasets"):
            make_task("sara/GSM8K-v0", hf_dataset="openai/gsm8k", hf_config="main")
    else:  # never downloads: a dataset that is not cached is an error
        with pytest.raises(ConfigError):
            make_task("sara/GSM8K-v0", hf_dataset="sara-test/definitely-not-cached", hf_config="main")


def test_math_task_env_scores_in_worker_processes() -> None:
    """MATH through TaskEnv: auto mode = spawned worker processes (math-verify's alarms work there)."""
    task = make_task("sara/MATH-v0")
    p = task.prompts[0]
    answer = p.answer["answer"]
    texts = [f"so \\boxed{{{answer}}}", r"\boxed{123456}", "", r"\boxed{9^{9^{9^{9}}}}", "x" * 200_000,
             f"\\boxed{{{answer}}}" * 1000]
    backend = EchoBackend(texts)
    with TaskEnv(task, backend, workers=1, timeout_s=20.0) as env:
        assert env.scorer.mode == "process"
        out = env.rollout([RolloutRequest(unit_id=0, pool_index=0, prompt=p, seeds=tuple(range(len(texts))))])
        assert [r.reward for r in out[0]] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        m = env.metrics()
        assert m["env/verifier_errors"] == 0 and m["env/verifier_timeouts"] == 0
