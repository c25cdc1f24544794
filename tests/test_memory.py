"""``sara.memory`` and ``PhaseTimer(memory=True)``: a phase's peak is the largest resident size inside it, a phase
timed inside another counts toward both, a later phase's window does not see an earlier one's peak, and the process's
peak keeps every mark a window cleared. Blocks are anonymous mappings of 96 MiB, written, then unmapped."""

from __future__ import annotations

import math
import mmap

import pytest

from sara.memory import peak_rss_mb, reset_peak_rss, rss_mb
from sara.timing import PhaseTimer

MIB = 1 << 20
ONES = b"\x01" * MIB


def _touch(mib: int) -> None:
    """Make ``mib`` MiB resident and give them back: a private anonymous mapping written through, then unmapped
    (not malloc, whose heap may serve it from pages already resident)."""
    with mmap.mmap(-1, mib * MIB) as block:
        for at in range(0, mib * MIB, MIB):
            block[at:at + MIB] = ONES


@pytest.fixture
def windows():
    if math.isnan(rss_mb()) or not reset_peak_rss():
        pytest.skip("this platform reports no resident size or cannot restart its peak")


def test_each_phase_reports_its_own_peak_and_the_outer_one_both(windows):
    timer = PhaseTimer(memory=True)
    start = rss_mb()
    with timer("step"):
        with timer("big"):
            _touch(96)
        after = rss_mb()
        with timer("small"):
            pass
    peaks = {key.removeprefix("sys/peak_rss_mb/"): v for key, v in timer.metrics().items() if key.startswith("sys/")}
    assert set(peaks) == {"step", "big", "small"}
    assert peaks["big"] > start + 64  # the 96 MiB block was resident inside 'big'
    assert peaks["small"] < after + 32  # a window restarted after 'big' does not count its mark
    assert peaks["step"] >= peaks["big"]  # the outer phase saw it
    assert peak_rss_mb() >= peaks["big"]  # the process's peak kept the mark the inner windows cleared


def test_a_phase_timed_twice_keeps_its_largest_peak(windows):
    timer = PhaseTimer(memory=True)
    with timer("collect"):
        _touch(96)
    first = timer.peaks["collect"]
    with timer("collect"):
        pass
    assert timer.peaks["collect"] == first


def test_without_memory_only_seconds():
    timer = PhaseTimer()
    with timer("collect"):
        _touch(8)
    assert set(timer.metrics()) == {"time/collect"} and timer.peaks == {}
