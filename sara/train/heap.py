"""Where a run's freed memory goes: the process heap (glibc ``malloc``) and the CPU kernel caches of oneDNN.

An update allocates and frees many buffers of a few to a few hundred MB (activations, gradients, logits). glibc
serves a request above its mmap threshold with a private mapping that ``free`` unmaps at once, and a smaller one from
its heap, which keeps freed pages resident until a trim. Its threshold is dynamic: freeing a mapped buffer raises it
to that buffer's size (up to 32 MB on 64-bit), so after the first steps most activations come from the heap, and
resident memory holds the high-water mark of every update's temporaries on top of what is live.

``bound_heap`` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic adjustment off), so
buffers of ``MMAP_THRESHOLD`` bytes or more always go back to the OS when freed; ``trim_heap`` hands back the free
pages of the heap itself (``malloc_trim``). Both change nothing but where freed memory goes; on a platform without
glibc they do nothing. The same threshold can be set from outside with
``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=<bytes>`` or ``MALLOC_MMAP_THRESHOLD_=<bytes>``; ``bound_heap`` leaves
a threshold set that way alone.

oneDNN (torch's CPU kernels for bfloat16 matmuls where the CPU has them natively) keeps each primitive it builds, and
torch's wrapper (ideep) keeps each matmul it plans, in caches keyed by shape that hold 1,024 entries each by default.
A run's shapes change with every micro-batch and generation round (positions, rows), so both caches grow step after
step until full: about 1-2 MB per shape. ``bound_kernel_caches`` caps both at ``KERNEL_CACHE_CAPACITY`` entries, enough
for one layer's forward and backward shapes, through the variables each library reads the first time it uses its
cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, ``LRU_CACHE_CAPACITY``): call it before the process's first matmul; a
value the user set is kept.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["KERNEL_CACHE_CAPACITY", "KERNEL_CACHE_ENV", "MMAP_THRESHOLD", "bound_heap", "bound_kernel_caches",
           "trim_heap"]

MMAP_THRESHOLD = 1 << 20
"""Bytes from which a buffer is mapped on its own and unmapped when freed (glibc's default starts at 128 KiB and
drifts up to 32 MiB)."""

KERNEL_CACHE_CAPACITY = 64
"""Entries of oneDNN's primitive cache and of ideep's matmul cache (each library's default: 1,024)."""
KERNEL_CACHE_ENV = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""The variables oneDNN and ideep read their cache capacity from, once, at their first use."""

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
_bound: bool | None = None


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 - musl has no mallopt: then this is not glibc
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def bound_heap() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD`` for this process (once; later calls return the first answer).

    Returns:
        True when the threshold is set (by this call, an earlier one, or ``GLIBC_TUNABLES``); False where the C
        library is not glibc.
    """
    global _bound
    if _bound is None:
        libc = _libc()
        if libc is None:
            _bound = False
        elif "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", "") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
            _bound = True  # the user chose a threshold for the process
        else:
            _bound = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _bound


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim``; nothing elsewhere)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def bound_kernel_caches() -> dict[str, str]:
    """Cap oneDNN's and ideep's shape-keyed caches at ``KERNEL_CACHE_CAPACITY`` entries, unless the user set a value.

    Effective only before the process's first oneDNN matmul (each library reads its variable once); ``sara``'s command
    line calls it first thing, the learner at its construction.

    Returns:
        ``{variable: value}`` as the process now has them.
    """
    for name in KERNEL_CACHE_ENV:
        os.environ.setdefault(name, str(KERNEL_CACHE_CAPACITY))
    return {name: os.environ[name] for name in KERNEL_CACHE_ENV}
