"""The Arithmetic task: format, verifier, generator, difficulty control."""

from __future__ import annotations

import pytest

from sara.config import ConfigError
from sara.envs.tasks import make_task
from sara.envs.tasks.arithmetic import (
    ALPHABET,
    ArithmeticConfig,
    few_shot_examples,
    generate_problems,
    verify,
)


@pytest.mark.parametrize(("completion", "answer", "expected"), [
    ("168", 168, 1.0),
    ("168\n", 168, 1.0),
    ("  168 and more text", 168, 1.0),
    ("-77", -77, 1.0),
    ("0168", 168, 1.0),  # leading zeros accepted
    ("-0", 0, 1.0),
    ("0", 0, 1.0),
    ("167", 168, 0.0),
    ("77", -77, 0.0),
    ("+168", 168, 0.0),  # only '-' is a sign
    ("168=", 168, 0.0),
    ("1 68", 168, 0.0),
    ("", 168, 0.0),
    ("   \n", 0, 0.0),
    ("\u0661\u0666\u0668", 168, 0.0),  # Arabic-Indic digits are not ASCII digits
    ("１６８", 168, 0.0),  # full-width digits
    ("168\x00", 168, 0.0),
    ("1" * 25, int("1" * 25), 0.0),  # over MAX_ANSWER_CHARS
    (" " * 300 + "168", 168, 0.0),  # answer beyond the scanned head
    ("1e3", 1000, 0.0),
    ("1_000", 1000, 0.0),
    ("nan", 0, 0.0),
])
def test_verify(completion: str, answer: int, expected: float) -> None:
    assert verify(completion, answer=answer) == expected


def test_verify_rejects_non_strings() -> None:
    assert verify(None, answer=1) == 0.0  # type: ignore[arg-type]
    assert verify(b"1", answer=1) == 0.0  # type: ignore[arg-type]


def test_prompts_format_and_answers() -> None:
    task = make_task("sara/Arithmetic-v0", min_digits=1, max_digits=3, pool_size=2000, eval_size=200, seed=3)
    assert task.id == "sara/Arithmetic-v0" and len(task.prompts) == 2000 and len(task.eval_prompts) == 200
    texts = [p.prompt for p in task.prompts]
    assert len(set(texts)) == len(texts)
    assert not set(texts) & {p.prompt for p in task.eval_prompts}, "held-out split overlaps the training pool"
    assert len({p.id for p in [*task.prompts, *task.eval_prompts]}) == 2200
    negative = 0
    for p in [*task.prompts, *task.eval_prompts]:
        text = p.prompt
        assert isinstance(text, str) and text.endswith("=") and set(text) <= set(ALPHABET)
        a, op, b = (text[:-1].partition("+") if "+" in text else text[:-1].partition("-"))
        assert 1 <= len(a) <= 3 and 1 <= len(b) <= 3 and str(int(a)) == a and str(int(b)) == b
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert p.answer == {"answer": expected}
        assert set(str(expected)) <= set(ALPHABET)
        assert task.score(str(expected), p) == 1.0 and task.score(str(expected + 1), p) == 0.0
        assert task.render(p) == text  # raw text, no chat template
        negative += expected < 0
    assert negative > 0
    assert {p.metadata["op"] for p in task.prompts} == {"+", "-"}


def test_seeded_and_controllable() -> None:
    a = make_task("sara/Arithmetic-v0", pool_size=50, eval_size=5, seed=1)
    b = make_task("sara/Arithmetic-v0", pool_size=50, eval_size=5, seed=1)
    c = make_task("sara/Arithmetic-v0", pool_size=50, eval_size=5, seed=2)
    assert a.prompts == b.prompts and a.eval_prompts == b.eval_prompts and a.prompts != c.prompts
    hard = make_task("sara/Arithmetic-v0:min_digits=4,max_digits=4,ops=+", pool_size=100, eval_size=0)
    assert all(p.metadata["digits"] == (4, 4) and "+" in p.prompt for p in hard.prompts)
    assert hard.max_new_tokens == 6
    pos = make_task("sara/Arithmetic-v0", ops="-", allow_negative=False, pool_size=300, eval_size=0)
    assert all(p.answer["answer"] >= 0 for p in pos.prompts)


def test_small_space_is_enumerated_exactly() -> None:
    train, held_out = generate_problems(ArithmeticConfig(max_digits=1, ops="+", pool_size=90, eval_size=10))
    assert len({p.prompt for p in train + held_out}) == 100


@pytest.mark.parametrize("options", [
    {"min_digits": 3, "max_digits": 2},
    {"max_digits": 10},
    {"ops": "*"},
    {"ops": ""},
    {"ops": "++"},
    {"pool_size": 0},
    {"max_digits": 1, "pool_size": 200, "eval_size": 1},
    {"digits": 3},
])
def test_invalid_config(options: dict) -> None:
    with pytest.raises(ConfigError):
        make_task("sara/Arithmetic-v0", **options)


def test_few_shot_examples_prefix_every_prompt_and_stay_out_of_both_splits() -> None:
    bare = make_task("sara/Arithmetic-v0", max_digits=1, ops="+", pool_size=80, eval_size=17)
    task = make_task("sara/Arithmetic-v0", max_digits=1, ops="+", pool_size=80, eval_size=17, shots=3)
    examples = few_shot_examples(ArithmeticConfig(max_digits=1, ops="+", pool_size=80, eval_size=17, shots=3))
    assert len(examples) == 3 and task.stop == ("\n",) and bare.stop == ()
    assert task.template == "".join(e + "\n" for e in examples) + "{prompt}"
    for line in examples:  # each is a correct worked example, e.g. "8+2=10"
        lhs, rhs = line.split("=")
        a, b = lhs.split("+")
        assert int(a) + int(b) == int(rhs)
    questions = {p.prompt for p in (*task.prompts, *task.eval_prompts)}
    assert len(questions) == 97 and not questions & {e.split("=")[0] + "=" for e in examples}
    rendered = task.render(task.prompts[0])
    assert rendered.endswith("\n" + task.prompts[0].prompt) and rendered.count("\n") == 3
    assert task.score(f"{task.prompts[0].answer['answer']}\n", task.prompts[0]) == 1.0
    assert bare.render(bare.prompts[0]) == bare.prompts[0].prompt  # shots=0: the bare prompt, as before


def test_few_shot_examples_count_against_the_problem_space() -> None:
    with pytest.raises(ConfigError, match="shots"):
        make_task("sara/Arithmetic-v0", max_digits=1, ops="+", pool_size=80, eval_size=20, shots=1)
