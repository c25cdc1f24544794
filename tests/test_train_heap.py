"""``sara.train.heap``: with ``bound_heap`` a freed buffer of ``MMAP_THRESHOLD`` bytes or more leaves the resident set
at once; without it glibc's dynamic threshold keeps such buffers in its heap after a larger one was freed. Each case
runs in a fresh interpreter (the threshold is per process), allocating through ``malloc`` directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sara.train import heap

SCRIPT = r"""
import ctypes, json, sys
from sara.train.heap import bound_heap
def current_rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
if sys.argv[1] == "bound":
    assert bound_heap()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
MB = 1 << 20
big = libc.malloc(16 * MB); ctypes.memset(big, 1, 16 * MB); libc.free(big)  # glibc now serves < 16 MB from its heap
base = current_rss_mb()
bufs = [libc.malloc(4 * MB) for _ in range(64)]
for b in bufs:
    ctypes.memset(b, 1, 4 * MB)
for b in bufs[:-1]:  # the last one stays: the heap cannot shrink from its top past it
    libc.free(b)
print(json.dumps({"held_mb": current_rss_mb() - base}))
"""


def _held(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["held_mb"])


@pytest.mark.skipif(heap._libc() is None, reason="glibc only")
def test_a_bounded_heap_returns_freed_buffers_at_once():
    bounded, dynamic = _held("bound"), _held("plain")
    assert bounded < 40, bounded  # the one 4 MB buffer still held, and noise
    assert dynamic > 200, dynamic  # the control: 63 freed 4 MB buffers still resident


@pytest.mark.skipif(heap._libc() is None, reason="glibc only")
def test_bound_heap_leaves_a_threshold_chosen_outside_alone(monkeypatch):
    calls = []

    class FakeLibc:
        def mallopt(self, *args):
            calls.append(args)
            return 1

    monkeypatch.setattr(heap, "_bound", None)
    monkeypatch.setattr(heap, "_libc", lambda: FakeLibc())
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert heap.bound_heap() and calls == []
    monkeypatch.setattr(heap, "_bound", None)
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert heap.bound_heap() and calls == [(-3, heap.MMAP_THRESHOLD)]
    assert heap.bound_heap() and len(calls) == 1  # once per process
