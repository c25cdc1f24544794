"""Thread-mode scoring keeps its threads bounded: helpers are reused from batch to batch, abandoned calls are capped,
and a system that refuses new threads does not fail a batch (issue 51: ``RuntimeError: can't start new thread`` from
the verifier thread in a long TRL run)."""

from __future__ import annotations

import threading

import pytest

from sara.envs.tasks import scoring
from sara.envs.tasks.scoring import MAX_STUCK_THREADS, OK, TIMEOUT, BatchScorer

RELEASE = threading.Event()
SEEN: set[threading.Thread] = set()


def recording(completion: str) -> float:
    """Records the thread it runs in; hangs on ``"hang"`` until the test releases it."""
    SEEN.add(threading.current_thread())
    if completion == "hang":
        RELEASE.wait(60)
    return 1.0


@pytest.fixture(autouse=True)
def _fresh():
    SEEN.clear()
    RELEASE.clear()
    yield
    RELEASE.set()  # let abandoned calls return, so their threads end
    for t in list(SEEN):
        if t is not threading.main_thread():
            t.join(5)


def test_many_batches_reuse_one_helper_thread() -> None:
    before = threading.active_count()
    with BatchScorer(recording, mode="thread", timeout_s=5.0) as scorer:
        for _ in range(300):
            r = scorer.score(["a", "b", "c"], [{}] * 3)
            assert r.status.tolist() == [OK, OK, OK]
            assert threading.active_count() <= before + 1
    assert len(SEEN) == 1  # one helper for all 300 batches, not a thread per batch
    assert not any(t.is_alive() for t in SEEN)  # close() ends the idle helper


def test_hanging_calls_keep_the_thread_count_bounded() -> None:
    before = threading.active_count()
    with BatchScorer(recording, mode="thread", timeout_s=0.02) as scorer:
        results = [scorer.score(["ok", "hang", "ok"], [{}] * 3) for _ in range(3 * MAX_STUCK_THREADS)]
        assert threading.active_count() <= before + MAX_STUCK_THREADS + 1
    assert all(r.status[1] == TIMEOUT for r in results)
    assert results[0].status.tolist() == [OK, TIMEOUT, OK]
    assert results[-1].status.tolist() == [TIMEOUT] * 3  # past the cap the batch times out at once
    assert scorer.metrics()["verifier/timeouts"] == sum(int((r.status == TIMEOUT).sum()) for r in results)


def test_a_refused_thread_scores_in_the_callers_thread(monkeypatch) -> None:
    def refuse(self, *args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(scoring, "_START_RETRIES_S", (0.0, 0.0))
    monkeypatch.setattr(threading.Thread, "start", refuse)
    with BatchScorer(recording, mode="thread", timeout_s=1.0) as scorer:
        r = scorer.score(["a", "b"], [{}] * 2)
    assert r.status.tolist() == [OK, OK] and SEEN == {threading.main_thread()}
