"""``sara.train.heap``. With ``bound_heap`` a freed buffer of ``MMAP_THRESHOLD`` bytes or more leaves the resident set
at once; without it glibc's dynamic threshold keeps such buffers in its heap after a larger one was freed. Each case
runs in a fresh interpreter (the threshold is per process), allocating through ``malloc`` directly. With
``bound_kernel_caches`` a bfloat16 matmul over ever new shapes stops growing the process once oneDNN's and ideep's
caches are full (where the CPU runs it through oneDNN)."""

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


CACHES = r"""
import json, sys
import torch
from sara.train.heap import bound_heap, bound_kernel_caches, trim_heap
def current_rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
bound_heap()  # freed buffers leave at once in both cases: what stays is what the caches hold
if sys.argv[1] == "bound":
    bound_kernel_caches()
torch.set_num_threads(1)
w = torch.randn(1536, 576, dtype=torch.bfloat16, requires_grad=True)
torch.nn.functional.linear(torch.randn(8, 576, dtype=torch.bfloat16), w)
base = current_rss_mb()
for rows in range(100, 300):  # a new shape each call, as micro-batches and generation rounds bring them
    x = torch.randn(rows, 576, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.linear(x, w).sum().backward()
trim_heap()  # what the heap freed goes back too: what stays is what the caches hold
print(json.dumps({"grown_mb": current_rss_mb() - base}))
"""


def _grown(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in heap.KERNEL_CACHE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-c", CACHES, mode], env=env, capture_output=True, text=True, timeout=300,
                         check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["grown_mb"])


def test_bounded_kernel_caches_stop_growing_with_new_shapes():
    unbounded = _grown("plain")
    if unbounded < 250:
        pytest.skip(f"this CPU's bfloat16 matmuls keep no oneDNN primitive per shape (grew {unbounded:.0f} MB)")
    bounded = _grown("bound")
    assert bounded < 110, (bounded, unbounded)  # 64 shapes in each cache, where the control kept 200


def test_bound_kernel_caches_sets_defaults_and_keeps_the_users(monkeypatch):
    for name in heap.KERNEL_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    assert heap.bound_kernel_caches() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(heap.KERNEL_CACHE_CAPACITY),
                                          "LRU_CACHE_CAPACITY": "7"}
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(heap.KERNEL_CACHE_CAPACITY)


def test_the_command_line_bounds_the_caches_before_any_command(monkeypatch, capsys):
    from sara import cli

    for name in heap.KERNEL_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    assert cli.main([]) == 2  # no command: help only
    assert all(os.environ[name] == str(heap.KERNEL_CACHE_CAPACITY) for name in heap.KERNEL_CACHE_ENV)
