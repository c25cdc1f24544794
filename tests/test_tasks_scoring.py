"""Batch scoring: time limits, errors, non-numeric results, worker processes."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from sara.envs.tasks.arithmetic import verify as arithmetic_verify
from sara.envs.tasks.scoring import ERROR, NOT_APPLICABLE, OK, TIMEOUT, BatchScorer, score_batch


def nasty(completion: str) -> object:
    """A verifier that misbehaves on command (module-level, so worker processes can import it)."""
    if completion == "sleep":
        time.sleep(30)
    if completion == "raise":
        raise ValueError("boom")
    if completion == "recurse":
        return nasty("recurse")
    if completion == "nan":
        return float("nan")
    if completion == "inf":
        return float("-inf")
    if completion == "huge":
        return 10**400
    if completion == "none":
        return None
    if completion == "str":
        return "1.0"
    if completion == "alarm":  # math-verify style: signal.alarm works only in a main thread
        signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))
        return 0.5
    if completion == "die":
        os._exit(3)
    if completion == "exit":
        raise SystemExit(1)
    if completion == "np":
        return np.float32(0.25)
    return True if completion == "true" else 1.0


CASES = ["ok", "raise", "recurse", "nan", "inf", "huge", "none", "str", "true", "ok", "exit", "np"]
EXPECTED = [OK, ERROR, ERROR, ERROR, ERROR, ERROR, NOT_APPLICABLE, ERROR, OK, OK, ERROR, OK]


@pytest.mark.parametrize("mode", ["inline", "thread"])
def test_in_process_modes(mode: str) -> None:
    with BatchScorer(nasty, mode=mode, timeout_s=5.0) as scorer:  # type: ignore[arg-type]
        r = scorer.score(CASES, [{}] * len(CASES))
    assert r.status.tolist() == EXPECTED
    assert r.rewards.tolist() == [1.0, 0, 0, 0, 0, 0, 0, 0, 1.0, 1.0, 0.0, 0.25]
    assert r.num_errors == 7 and r.num_not_applicable == 1 and r.num_timeouts == 0
    assert any("boom" in e for e in r.errors)
    assert scorer.metrics()["verifier/errors"] == 7


def test_thread_mode_times_out_and_continues() -> None:
    cases = ["ok", "sleep", "ok", "alarm", "ok"]
    with BatchScorer(nasty, mode="thread", timeout_s=0.2) as scorer:  # type: ignore[arg-type]
        r = scorer.score(cases, [{}] * len(cases))
    # the stuck call is abandoned; signal handlers cannot be installed outside the main thread
    assert r.status.tolist() == [OK, TIMEOUT, OK, ERROR, OK]
    assert r.rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert scorer.metrics()["verifier/timeouts"] == 1


def test_process_mode_kills_and_replaces_workers() -> None:
    cases = ["ok", "sleep", "alarm", "die", "raise", *CASES, "ok"]
    with BatchScorer(nasty, mode="process", timeout_s=0.5, workers=2,  # type: ignore[arg-type]
                     mp_context="fork") as scorer:  # fast restarts here; the MATH task tests cover spawn
        r = scorer.score(cases, [{}] * len(cases))
        assert r.status.tolist() == [OK, TIMEOUT, OK, ERROR, ERROR, *EXPECTED, OK]
        assert r.rewards[2] == 0.5  # signal handlers work in a worker's main thread
        m = scorer.metrics()  # the timeout, and the worker that died on "die" twice (it is scored again once)
        assert m["verifier/worker_restarts"] == 3 and m["verifier/timeouts"] == 1
        assert any("died twice on this item" in e for e in r.errors)
        # the pool keeps working after restarts, and across calls
        again = scorer.score(["1", "2"], [{"answer": 1}, {"answer": 1}])
        assert again.status.tolist() == [ERROR, ERROR]  # nasty takes no answer keyword: a TypeError, counted
    assert scorer._pool.workers == []


def test_score_batch_arithmetic_and_lengths() -> None:
    comps = [str(i) for i in range(200)]
    answers = [{"answer": i if i % 2 else -1} for i in range(200)]
    r = score_batch(arithmetic_verify, comps, answers, mode="thread")
    assert r.rewards.dtype == np.float64 and r.rewards.sum() == 100
    with pytest.raises(ValueError, match="answers"):
        score_batch(arithmetic_verify, comps, answers[:3])
    assert score_batch(arithmetic_verify, [], []).rewards.shape == (0,)


@pytest.mark.parametrize("kwargs", [{"mode": "fork"}, {"timeout_s": 0}, {"timeout_s": -1.0}])
def test_invalid_scorer_options(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        BatchScorer(arithmetic_verify, **kwargs)
