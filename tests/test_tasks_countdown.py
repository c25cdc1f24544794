"""Countdown: the ast/Fraction verifier and the solvable-instance generator."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from sara.config import ConfigError
from sara.envs.tasks import make_task
from sara.envs.tasks.countdown import (
    MAX_DEPTH,
    MAX_EXPR_CHARS,
    CountdownConfig,
    evaluate_expression,
    extract_answer,
    generate_instances,
    verify,
)

NUMS, TARGET = [25, 7, 3, 3], 26  # 25 + 7 - 3 - 3


def a(expr: str) -> str:
    return f"<think>reasoning</think>\n<answer>{expr}</answer>"


@pytest.mark.parametrize(("completion", "expected"), [
    (a("25 + 7 - 3 - 3"), 1.0),
    (a("(25 + 7) - (3 + 3)"), 1.0),
    (a("25-3+7-3"), 1.0),  # no spaces
    (a("(((25)) + 7 - 3) - 3"), 1.0),
    (a(" 3 * 3 / 3 * 25 - 7 + 8 "), 0.0),  # 3 used three times, 8 not given
    (a("25 + 7 - 6"), 0.0),  # right value, 6 not given
    (a("25 + 3 - 3 + 7 - 3"), 0.0),  # 3 used three times
    (a("25 + 7 - 3"), 0.0),  # a 3 unused (and 29)
    (a("25 + 7 - 3 * 3"), 0.0),  # all numbers, wrong value (23)
    ("<answer>25 + 7 - 3</answer><answer>25 + 7 - 3 - 3</answer>", 1.0),  # the last tag counts
    ("<answer>25 + 7 - 3 - 3</answer><answer>25 + 7 - 3</answer>", 0.0),
    ("25 + 7 - 3 - 3", 0.0),  # no tag
    ("<answer>25 + 7 - 3 - 3", 0.0),  # unclosed
    ("<answer><answer>25 + 7 - 3 - 3</answer>", 1.0),  # innermost opening tag before the last closing one
    (a("25 + 7 - 3 - 3 = 26"), 0.0),  # only the expression is accepted
    (a("-3 + 25 + 7 - 3"), 0.0),  # no unary minus
    (a("25 + 7 - 3 // 3 - 1"), 0.0),
    (a("25 + 7 - 3 ** 1 - 3"), 0.0),
    (a("25.0 + 7 - 3 - 3"), 0.0),
    (a("25 + 7 - 3 / (3 - 3)"), 0.0),  # division by zero
    (a("25 + 7 - 3 - 3 +"), 0.0),
    (a(""), 0.0),
])
def test_verify_cases(completion: str, expected: float) -> None:
    assert verify(completion, numbers=NUMS, target=TARGET) == expected


def test_exact_rational_arithmetic() -> None:
    # 1/3 * 3 is exactly 1 (floats would give 0.9999999999999999 in some orders)
    assert verify(a("(1 / 3) * 3 + 5"), numbers=[1, 3, 3, 5], target=6) == 1.0
    assert verify(a("7 / 2 * 2"), numbers=[7, 2, 2], target=7) == 1.0
    assert verify(a("7 / 2"), numbers=[7, 2], target=3) == 0.0  # 3.5, no rounding
    assert evaluate_expression("10 / 4") == (Fraction(5, 2), [10, 4])


def test_multiset_semantics() -> None:
    assert verify(a("5 * 5 - 3"), numbers=[5, 5, 3], target=22) == 1.0
    assert verify(a("5 * 5 - 3"), numbers=[5, 3, 3], target=22) == 0.0
    assert verify(a("5 + 3"), numbers=[5, 5, 3], target=8) == 0.0  # a 5 unused
    assert verify(a("05 + 3"), numbers=[5, 3], target=8) == 0.0  # not a Python int literal


def test_format_score() -> None:
    assert verify(a("5 + 4"), numbers=[5, 4], target=10, format_score=0.1) == 0.1
    assert verify("no tag", numbers=[5, 4], target=10, format_score=0.1) == 0.0
    assert verify(a("5 + 5"), numbers=[5, 4], target=10, format_score=0.1) == 0.1  # parses, wrong numbers
    task = make_task("sara/Countdown-v0", pool_size=5, eval_size=0, format_score=0.25)
    p = task.prompts[0]
    assert task.score(a("1 + 1"), p) == 0.25 and task.score(a(str(p.metadata["solution"])), p) == 1.0


def test_limits_are_enforced() -> None:
    ok = "+".join(["1"] * (MAX_EXPR_CHARS // 2))
    assert evaluate_expression(ok) is not None
    assert evaluate_expression(ok + "+1") is None  # over MAX_EXPR_CHARS
    assert evaluate_expression("(" * MAX_DEPTH + "1" + ")" * MAX_DEPTH) is not None
    assert evaluate_expression("(" * (MAX_DEPTH + 1) + "1" + ")" * (MAX_DEPTH + 1)) is None
    assert evaluate_expression("9**9**9**9") is None  # ** is not in the grammar: never computed
    assert extract_answer("x</answer>") is None and extract_answer("<answer>1</answer>tail") == "1"


def test_generator_is_solvable_seeded_and_split() -> None:
    cfg = CountdownConfig(pool_size=300, eval_size=30, seed=4)
    train, held_out = generate_instances(cfg)
    assert (train, held_out) == generate_instances(cfg)
    assert train != generate_instances(cfg.model_copy(update={"seed": 5}))[0]
    keys = [(tuple(sorted(p.answer["numbers"])), p.answer["target"]) for p in train + held_out]
    assert len(set(keys)) == len(keys)
    assert Counter(len(p.answer["numbers"]) for p in train).keys() == {3, 4}
    for p in train + held_out:
        assert 1 <= p.answer["target"] <= 100 and all(1 <= x <= 99 for x in p.answer["numbers"])
        assert verify(a(p.metadata["solution"]), **p.answer) == 1.0
        assert str(p.answer["numbers"]) in str(p.prompt) and "<answer>" in str(p.prompt)


def test_task_rendering_and_options() -> None:
    chat = make_task("sara/Countdown-v0", pool_size=3, eval_size=1)
    assert chat.render(chat.prompts[0])[0]["role"] == "user"  # type: ignore[index]
    base = make_task("sara/Countdown-v0", pool_size=3, eval_size=1, chat=False)
    text = base.render(base.prompts[0])
    assert isinstance(text, str) and text.endswith("<think>") and "User: Using the numbers" in text
    with pytest.raises(ConfigError, match="min_numbers"):
        make_task("sara/Countdown-v0", min_numbers=5, max_numbers=4)
    with pytest.raises(ConfigError, match="pool_size"):
        make_task("sara/Countdown-v0", min_numbers=2, max_numbers=2, max_value=2, max_target=2, pool_size=20,
                  eval_size=0)
