"""``sara/Chain-v0``: the worked running total (reasoning-length completions for a small LLM)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sara.config import ConfigError
from sara.envs.tasks import make_task
from sara.envs.tasks.chain import MAX_SCAN_CHARS, question, solve, verify


def test_chains_stay_in_digits_and_the_worked_solution_reaches_the_answer():
    task = make_task("sara/Chain-v0", pool_size=300, eval_size=50, shots=3, seed=1)
    for p in (*task.prompts, *task.eval_prompts):
        tokens = p.prompt.split()
        v = int(tokens[0])
        for op, x in zip(tokens[1::2], tokens[2::2]):
            assert op in "+-" and 1 <= int(x) <= 9
            v = v + int(x) if op == "+" else v - int(x)
            assert 0 <= v <= 9  # every running value is a digit
        assert p.answer["answer"] == v and p.metadata["component"] == f"steps{p.metadata['steps']}"
        assert 2 <= p.metadata["steps"] <= 6


def test_splits_are_disjoint_deterministic_and_the_examples_are_neither():
    a = make_task("sara/Chain-v0", pool_size=200, eval_size=40, shots=3, seed=2)
    b = make_task("sara/Chain-v0", pool_size=200, eval_size=40, shots=3, seed=2)
    train, held = {p.prompt for p in a.prompts}, {p.prompt for p in a.eval_prompts}
    assert len(train) == 200 and len(held) == 40 and not train & held
    assert [p.prompt for p in a.prompts] == [p.prompt for p in b.prompts] and a.template == b.template
    shots = [line[3:] for line in a.template.splitlines() if line.startswith("Q: ") and "{prompt}" not in line]
    assert len(shots) == 3 and not set(shots) & (train | held)
    assert a.template.endswith("Q: {prompt}\nA:") and a.stop == ("\n",)
    assert a.max_new_tokens >= 64  # room for the longest chain's worked solution


def test_every_character_is_in_the_alphabet():
    task = make_task("sara/Chain-v0", pool_size=300, eval_size=50, shots=5, seed=3)
    text = task.template + "".join(p.prompt + solve_answer for p in task.prompts
                                   for solve_answer in [f" answer: {p.answer['answer']}"])
    assert set(text.replace("{prompt}", "")) <= set(task.metadata["alphabet"])


def test_worked_solution_format():
    chain = (9, (("-", 6), ("+", 1), ("+", 2)))
    assert question(chain) == "9 - 6 + 1 + 2"
    assert solve(chain) == (" 9-6=3, 3+1=4, 4+2=6. answer: 6", 6)


@pytest.mark.parametrize(("completion", "score"), [
    (" 9-6=3, 3+1=4, 4+2=6. answer: 6", 1.0),
    (" 9-6=3, 3+1=4, 4+2=7. answer: 6", 1.0),  # the answer is read, not the steps
    (" answer: 5, then answer: 6", 1.0),  # the last answer counts
    (" answer: 6, no wait answer: 5", 0.0),
    (" 9-6=3, 3+1=4, 4+2=6.", 0.0),  # no answer
    (" answer: 66", 0.0), (" answer: -6", 0.0), (" ANSWER: 6", 0.0), (" answer: 6.", 1.0),
    (" answer: 6.5", 0.0), (" answer: 6/7", 0.0), (" answer: 6e2", 0.0), (" answer: 6-1", 0.0), (" answer: 6^2", 0.0),
    (" answer: 0006", 1.0), (" answer: 000000006", 0.0),  # longer than MAX_ANSWER_CHARS digits
    ("", 0.0),
])
def test_verifier_reads_the_last_answer(completion, score):
    assert verify(completion, answer=6) == score


def test_verifier_is_bounded_and_total():
    assert verify("x" * MAX_SCAN_CHARS + " answer: 6", answer=6) == 0.0
    assert verify(None, answer=6) == 0.0  # type: ignore[arg-type]
    assert verify(" answer: 1", answer=True) == 0.0  # type: ignore[arg-type]


@given(st.text(max_size=300), st.integers(0, 9))
def test_verifier_never_raises(text, answer):
    assert verify(text, answer=answer) in (0.0, 1.0)


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="min_steps"):
        make_task("sara/Chain-v0", min_steps=5, max_steps=3)
    with pytest.raises(ConfigError, match="pool_size"):
        make_task("sara/Chain-v0", min_steps=1, max_steps=1, pool_size=500)  # 1-step chains: too few distinct ones
