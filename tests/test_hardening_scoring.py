"""Model output is data: every verifier gives the right score on the issue's cases, bounded in time and memory in every
scoring mode (MATH only in worker processes: thread / inline are refused for it, the gym env included), and a Ctrl-C
does not kill verifier workers (an interrupted verification is not a wrong answer). Property: any hostile text gives
0 or 1 quickly, and a right answer after it still scores 1."""

from __future__ import annotations

import os
import signal
import threading
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sara.config import ConfigError
from sara.envs.tasks import arithmetic, countdown, gsm8k, make_task
from sara.envs.tasks.scoring import OK, BatchScorer, scorer_mode


def slow_double(completion: str) -> float:
    """A verifier that takes a while (module-level, so worker processes can import it)."""
    time.sleep(0.4)
    return 1.0 if completion == "right" else 0.5


def hog(completion: str) -> float:
    """A verifier that asks for far more memory than a worker may add (module-level, for worker processes)."""
    return float(len(bytearray(int(completion) * 2**20)) > 0)


# ------------------------------------------------------------------------------------------------ case 12
@pytest.mark.parametrize(("completion", "gold", "mode", "expected"), [
    ("1" + "0" * 40 + "234567890", "234567890", "flexible", 0.0),  # never the tail of an over-long number
    ("#### 1,2,3", "123", "strict", 0.0),  # a list is not a number with thousands separators
    ("#### 1,234", "1234", "strict", 1.0),
    ("#### -$5", "-5", "strict", 1.0),
    ("#### $-5", "-5", "strict", 1.0),  # both orders of sign and dollar
    ("#### 10000000000000000000000", 1e22, "strict", 1.0),  # a float gold compares exactly
    ("1000 " + "x" * 4094, "0", "flexible", 0.0),  # the whole completion is read, not its last 4096 characters
    ("1000 " + "x" * 4094, "1000", "flexible", 1.0),
    ("1000" + "x" * 4094, "1000", "flexible", 0.0),  # trailing letters: not a number
])
def test_gsm8k_scores_the_issue_cases_right(completion, gold, mode, expected):
    assert gsm8k.verify(completion, answer=gold, mode=mode) == expected


def test_arithmetic_does_not_truncate_a_float_gold():
    assert arithmetic.verify("168", answer=168.9) == 0.0
    assert arithmetic.verify("168", answer=168.0) == 1.0 and arithmetic.verify("168", answer=168) == 1.0


def test_math_equation_is_an_answer_only_when_its_sides_agree():
    math_task = pytest.importorskip("sara.envs.tasks.math")
    pytest.importorskip("math_verify")
    assert math_task.verify("\\boxed{6=5}", answer="5") == 0.0
    assert math_task.verify("\\boxed{x=5}", answer="5") == 1.0
    assert math_task.verify("\\boxed{2+4=6}", answer="6") == 1.0


def test_countdown_does_not_copy_a_huge_answer():
    big = "<answer>" + "1" * 10**7 + "</answer>"
    tracemalloc.start()
    try:
        assert countdown.verify(big, numbers=[1, 2, 3], target=6) == 0.0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak  # a copy of the answer would be 10 MB
    assert countdown.verify("<answer> 1+2+3 </answer>", numbers=[1, 2, 3], target=6) == 1.0


# ------------------------------------------------------------------------------------------------ case 3
def _math():
    return make_task("sara/MATH-v0")


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_math_refuses_the_unbounded_modes(mode):
    task = _math()
    with pytest.raises(ConfigError, match=f"field 'scorer'.*scorer={mode} cannot bound it"):
        scorer_mode(mode, task)
    assert scorer_mode("auto", task) == "process" and scorer_mode("process", task) == "process"
    assert scorer_mode("auto", make_task("sara/Arithmetic-v0")) == "thread"


def test_math_env_refuses_thread_scoring():
    from sara.envs.task_env import TaskEnv
    from sara.testing.scripted import ScriptedBackend

    with pytest.raises(ConfigError, match="field 'scorer'"):
        TaskEnv(_math(), ScriptedBackend(), scorer_mode="thread")


def test_gym_env_scores_math_in_a_worker_process():
    pytest.importorskip("gymnasium")
    from sara.envs.gym import TextTaskEnv

    env = TextTaskEnv("sara/MATH-v0")
    try:
        assert env._scorer.mode == "process"
    finally:
        env.close()
    env = TextTaskEnv("sara/Arithmetic-v0")
    try:
        assert env._scorer.mode == "thread"
    finally:
        env.close()


def test_cli_refuses_thread_scoring_for_math_before_the_model_is_built(capsys, monkeypatch):
    from sara.cli import main
    from sara.policies import POLICIES

    monkeypatch.setattr(POLICIES, "factory", lambda *a, **k: pytest.fail("the policy was built"))
    capsys.readouterr()
    try:
        rc = main(["train", "--set", "task=sara/MATH-v0", "--set", "scorer=thread", "--out", "/tmp/sara-never"])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("sara: error: ") and "field 'scorer'" in err[0], err


def test_a_sympy_bomb_is_stopped_in_a_worker_process():
    pytest.importorskip("math_verify")
    task = _math()
    bomb = "\\boxed{(x+y+z+1)^{9999}}"  # passes the text guards; sympy would expand it for minutes
    with BatchScorer(task.verifier, mode="process", timeout_s=1.0, workers=1) as scorer:
        scorer.score(["\\boxed{1}"], [{"answer": "1"}])  # the worker has imported sympy: the bomb's clock is its own
        t = time.monotonic()
        r = scorer.score([bomb, "\\boxed{2}"], [{"answer": "5"}, {"answer": "2"}])
        took = time.monotonic() - t
    assert r.rewards[0] == 0.0 and r.rewards[1] == 1.0, r
    assert took < 30, took


def test_a_worker_is_capped_in_memory():
    with BatchScorer(hog, mode="process", timeout_s=20.0, workers=1, memory_mb=64) as scorer:
        r = scorer.score(["1", "512", "1"], [{}, {}, {}])  # 512 MiB past a 64 MiB cap: refused, the worker lives on
    assert list(r.rewards) == [1.0, 0.0, 1.0] and r.status[1] != OK, r


# ------------------------------------------------------------------------------------------------ case 11
def test_ctrl_c_does_not_kill_verifier_workers():
    with BatchScorer(slow_double, mode="process", timeout_s=20.0, workers=2) as scorer:
        scorer.score(["warm", "warm"], [{}, {}])
        pids = [w.proc.pid for w in scorer._pool.workers]
        out = {}
        thread = threading.Thread(target=lambda: out.setdefault("r", scorer.score(["right"] * 4 + ["x"] * 4,
                                                                                   [{}] * 8)))
        thread.start()
        time.sleep(0.2)
        for pid in pids:  # what a Ctrl-C does to the whole process group, minus this test process
            os.kill(pid, signal.SIGINT)
        thread.join(60)
        r = out["r"]
        restarts = scorer.metrics()["verifier/worker_restarts"]
    assert list(r.rewards) == [1.0] * 4 + [0.5] * 4 and all(s == OK for s in r.status), r
    assert restarts == 0  # no worker died: nothing was scored 0 for being interrupted


# ------------------------------------------------------------------------------------------------ property
HOSTILE = st.lists(st.sampled_from(list("0123456789,.-$#+*/()<>=^{}\\ \n\tx") + ["####", "<answer>", "</answer>",
                                                                                    "\\boxed{", "1" * 50, "\u0663"]),
                   max_size=60).map("".join)
FAST = settings(max_examples=150, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def _timed(fn, *args, **kwargs) -> float:
    t = time.perf_counter()
    value = fn(*args, **kwargs)
    assert time.perf_counter() - t < 0.5
    assert value in (0.0, 1.0), value
    return value


def _money(gold: int, form: int) -> str:
    """``gold`` as a completion may write it: ``-5``, ``-$5``, ``$-5`` (``5``, ``$5``, ``5`` when positive)."""
    sign, digits = ("-" if gold < 0 else ""), str(abs(gold))
    return [f"{sign}{digits}", f"{sign}${digits}", f"${sign}{digits}"][form]


@FAST
@given(junk=HOSTILE, gold=st.integers(-10**6, 10**6), mode=st.sampled_from(["strict", "flexible"]),
       form=st.integers(0, 2), pad=st.sampled_from([0, 7, 5000]))
def test_gsm8k_any_text_scores_0_or_1_and_a_right_answer_after_it_scores_1(junk, gold, mode, form, pad):
    _timed(gsm8k.verify, junk, answer=str(gold), mode=mode)
    said = _money(gold, form)
    tail = (f"\nThe answer is\n#### {said}" if mode == "strict" else f"\nThe answer is {said}") + ". " + "x" * pad
    assert _timed(gsm8k.verify, junk + tail, answer=str(gold), mode=mode) == 1.0, (junk, tail[:40])
    assert _timed(gsm8k.verify, junk + tail, answer=float(gold), mode=mode) == 1.0, (junk, tail[:40])
    assert _timed(gsm8k.verify, junk + tail, answer=str(gold + 1), mode=mode) == 0.0, (junk, tail[:40])


@FAST
@given(junk=HOSTILE, gold=st.integers(-10**6, 10**6))
def test_arithmetic_any_text_scores_0_or_1_and_a_right_answer_before_it_scores_1(junk, gold):
    _timed(arithmetic.verify, junk, answer=gold)
    assert _timed(arithmetic.verify, f"{gold} " + junk, answer=gold) == 1.0
    assert _timed(arithmetic.verify, f"{gold} " + junk, answer=float(gold)) == 1.0
    assert _timed(arithmetic.verify, f"{gold} " + junk, answer=gold + 0.5) == 0.0  # never truncated to gold
    assert _timed(arithmetic.verify, f"{gold + 1} " + junk, answer=gold) == 0.0


@FAST
@given(junk=HOSTILE)
def test_countdown_any_text_scores_0_or_1_and_a_right_answer_after_it_scores_1(junk):
    _timed(countdown.verify, junk, numbers=[3, 4, 5], target=35)
    assert _timed(countdown.verify, junk + "\n<answer>(3+4)*5</answer>", numbers=[3, 4, 5], target=35) == 1.0
    assert _timed(countdown.verify, junk + "\n<answer>3+4+5</answer>", numbers=[3, 4, 5], target=35) == 0.0
