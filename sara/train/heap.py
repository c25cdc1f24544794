"""The process heap the learner's buffers live in (glibc ``malloc``): where freed activation pages go.

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
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["MMAP_THRESHOLD", "bound_heap", "trim_heap"]

MMAP_THRESHOLD = 1 << 20
"""Bytes from which a buffer is mapped on its own and unmapped when freed (glibc's default starts at 128 KiB and
drifts up to 32 MiB)."""

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
