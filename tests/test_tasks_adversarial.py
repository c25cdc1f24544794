"""Untrusted completions: every verifier returns 0.0, raises nothing, executes nothing and hits its own limits.

``ADVERSARIAL_COMPLETIONS`` (sara.testing.task, > 100 cases: code injection, 9**9**9**9, 10^5 nested parentheses,
1 MB strings, unicode digits, NaN/inf, null bytes, unbalanced / repeated tags, ...) is scored by every built-in
verifier against answers that none of the cases contains, plus task-specific cases (numbers reused or missing).
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sara.envs.tasks import arithmetic, countdown, gsm8k, math
from sara.testing.task import ADVERSARIAL_COMPLETIONS

VERIFIERS: dict[str, tuple[Callable[..., float], dict[str, Any]]] = {
    "arithmetic": (arithmetic.verify, {"answer": 4242}),
    "countdown": (countdown.verify, {"numbers": [3, 7, 25], "target": 46}),
    "gsm8k-strict": (gsm8k.verify, {"answer": "4242"}),
    "gsm8k-flexible": (lambda c, **kw: gsm8k.verify(c, mode="flexible", **kw), {"answer": "4242"}),
    "math": (math.verify, {"answer": r"\frac{7}{3}"}),
    "aime": (math.verify_integer, {"answer": 617}),
}
PURE = ["arithmetic", "countdown", "gsm8k-strict", "gsm8k-flexible", "aime"]  # no sympy behind them
CALL_BUDGET = 5_000  # Python + C function calls one pure verifier call may make, whatever the completion


def _calls(fn: Callable[[], object]) -> tuple[object, int]:
    """``fn()`` and the number of function calls it made: a measure of work that machine load cannot change."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, count


def _injections(marker: Path) -> list[str]:
    payload = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    return [payload, f"<answer>{payload}</answer>", f"<answer>(1, {payload})[0]</answer>", f"#### {payload}",
            f"\\boxed{{{payload}}}", f"$\\boxed{{{payload}}}$", f"<answer>{payload} or 46</answer>"]


def test_set_size() -> None:
    assert len(ADVERSARIAL_COMPLETIONS) >= 100
    assert max(map(len, ADVERSARIAL_COMPLETIONS)) >= 1 << 20  # 1 MB strings are in
    assert any("(" * 100_000 in c for c in ADVERSARIAL_COMPLETIONS)


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_every_case_scores_zero_without_raising(name: str, tmp_path: Path) -> None:
    verify, answer = VERIFIERS[name]
    marker = tmp_path / "pwned"
    verify("warm-up \\boxed{1}", **answer)  # first math-verify calls import sympy and fill its caches
    verify("warm-up \\boxed{x y}", **answer)
    costly = []
    cases = [*ADVERSARIAL_COMPLETIONS, *_injections(marker)]
    for i, c in enumerate(cases):
        if name in PURE:  # bounded work, counted in calls (sympy-backed verifiers: the guards tested below)
            score, calls = _calls(lambda c=c: verify(c, **answer))
            if calls > CALL_BUDGET:
                costly.append((i, c[:40], calls))
        else:
            score = verify(c, **answer)
        assert score == 0.0, f"{name}: case #{i} {c[:60]!r} scored {score!r}"
    assert not costly, f"{name}: cases over {CALL_BUDGET} calls: {costly}"
    assert not marker.exists(), "an injected payload was executed"


def test_the_call_count_sees_unbounded_work() -> None:
    assert _calls(lambda: [abs(i) for i in range(2 * CALL_BUDGET)])[1] > CALL_BUDGET
    assert _calls(lambda: len("x" * (1 << 20)))[1] < 10


@pytest.mark.parametrize("name", PURE)
def test_pure_verifiers_never_call_eval_or_exec(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval/exec called on model output")

    verify, answer = VERIFIERS[name]
    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    for c in ADVERSARIAL_COMPLETIONS[:60]:
        assert verify(c, **answer) == 0.0


NUMS, TARGET = [3, 7, 25], 46  # 25 + 3 * 7


@pytest.mark.parametrize(("completion", "expected"), [
    ("<answer>25 + 3 * 7</answer>", 1.0),  # the correct answer, for contrast
    ("x" * (1 << 20) + "<answer>25 + 3 * 7</answer>", 1.0),  # found at the end of 1 MB
    ("<answer>25 + 3 * 7 + 3 - 3</answer>", 0.0),  # a number reused
    ("<answer>25 + 3 * 7 + 7 - 7</answer>", 0.0),
    ("<answer>25 + 21</answer>", 0.0),  # numbers missing, 21 not given
    ("<answer>46</answer>", 0.0),
    ("<answer>25 + 3 * 7 + 0</answer>", 0.0),  # an extra number
    ("<answer>25 + 3 * 7 * 1</answer>", 0.0),
    ("<answer>(25 + 3 * 7) / 1</answer>", 0.0),
    ("<answer>\uff12\uff15 + 3 * 7</answer>", 0.0),  # full-width digits
    ("<answer>\u0662\u0665 + 3 * 7</answer>", 0.0),  # Arabic-Indic digits
    ("<answer>25 + 3 \u00d7 7</answer>", 0.0),  # multiplication sign
    ("<answer>25 + 3 * 7\x00</answer>", 0.0),  # null byte
    ("<answer>25 + 3 * 7</answer><answer>", 1.0),  # a dangling opener after the last closed pair is ignored
    ("<answer>25 + 3 * 7</answer></answer>", 0.0),
    ("<answer>25 + 3 * 7</answer>\n<answer>25 + 3 + 7</answer>", 0.0),  # the last tag counts
    ("<answer>25 + 3 + 7</answer>\n<answer>25 + 3 * 7</answer>", 1.0),
    ("<answer>25+3*7=46</answer>", 0.0),
    ("<answer>sum([25, 3 * 7])</answer>", 0.0),
    ("<answer>25 + 3 * 7 if 1 else 0</answer>", 0.0),
    ("<answer>(25).__add__(3 * 7)</answer>", 0.0),
    ("<answer>25 + 3 * 7 # comment</answer>", 0.0),
    ("<answer>25 + 3 * 7;</answer>", 0.0),
    ("<answer>25 + 3 * 7\\</answer>", 0.0),
    ("<answer>" + "(" * 33 + "25 + 3 * 7" + ")" * 33 + "</answer>", 0.0),  # one level over MAX_DEPTH
    ("<answer>" + "(" * 32 + "25 + 3 * 7" + ")" * 32 + "</answer>", 1.0),  # at the limit
    ("<answer>" + " " * 190 + "25 + 3 * 7</answer>", 1.0),  # whitespace is stripped before the length check
    ("<answer>25 + 3 * 7" + " + 0 - 0" * 30 + "</answer>", 0.0),  # over MAX_EXPR_CHARS
])
def test_countdown_specific(completion: str, expected: float) -> None:
    assert countdown.verify(completion, numbers=NUMS, target=TARGET) == expected


def test_countdown_limits_are_what_stops_the_big_cases() -> None:
    for c in ["9**9**9**9", "(" * 100_000 + "1" + ")" * 100_000, "+".join(["1"] * 50_000), "9" * 5000,
              "10**100000", "2<<100000"]:
        assert countdown.evaluate_expression(c) is None
    assert len("(" * 100_000) > countdown.MAX_EXPR_CHARS


def test_math_guards_are_what_stops_the_big_cases() -> None:
    assert math.last_boxed("\\boxed{" * 100_000) is None  # brace depth
    assert math.last_boxed("\\boxed{" + "9" * 5000 + "}") is None  # length
    for content in ["9^{9^{9^{9}}}", "10^{100000}", "100000!", "9**9**9**9", "1\x00"]:
        assert not math.safe_for_sympy(content)


def test_arithmetic_and_gsm8k_limits() -> None:
    assert arithmetic.verify("4" * (arithmetic.MAX_ANSWER_CHARS + 1), answer=int("4" * 25)) == 0.0
    assert arithmetic.verify(" " * arithmetic.MAX_SCAN_CHARS + "4242", answer=4242) == 0.0
    assert gsm8k.verify("#### 4242 " + "x" * 10**6, answer="4242") == 1.0  # read whole, in linear time
    assert gsm8k.verify("#### 4242" + "x" * 10**6, answer="4242") == 0.0  # trailing letters: not a number
    assert gsm8k.verify("#### " + "4" * 100, answer="4" * 100) == 0.0  # over MAX_NUMBER_CHARS
