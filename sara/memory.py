"""This process's resident memory (Linux ``/proc/self``): now, its peak, and the peak of a window.

``peak_rss_mb`` is the whole process's peak, ``window_peak_mb`` the peak since the last ``reset_peak_rss``: a reset
restarts the kernel's high-water mark (``VmHWM``) at the current size and folds the mark it clears into the process's
peak first, so timing a window never lowers what ``peak_rss_mb`` reports. ``sara.timing.PhaseTimer(memory=True)``
uses the windows to report each phase's peak. Where there is no ``/proc`` these read NaN (``peak_rss_mb`` falls back
to ``getrusage``), and a reset does nothing.

Example:
    >>> peak_rss_mb() >= rss_mb() or rss_mb() != rss_mb()  # NaN off Linux
    True
"""

from __future__ import annotations

import math
import os

__all__ = ["device_memory_bytes", "machine_memory_bytes", "peak_rss_mb", "reset_peak_rss", "rss_mb", "window_peak_mb"]

_folded = 0.0  # the largest high-water mark a reset cleared, in MiB


def _status_mb(key: str) -> float:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def rss_mb() -> float:
    """This process's resident set size now, in MiB (``VmRSS``; NaN where there is none)."""
    return _status_mb("VmRSS:")


def window_peak_mb() -> float:
    """The peak resident size since the last ``reset_peak_rss`` (else since the process began), in MiB (``VmHWM``;
    NaN where there is none)."""
    return _status_mb("VmHWM:")


def reset_peak_rss() -> bool:
    """Start a new window: ``window_peak_mb`` restarts at the current resident size (``5`` to
    ``/proc/self/clear_refs``); ``peak_rss_mb`` keeps the mark it had.

    Returns:
        True when the window restarted; False where the platform cannot (the window stays the process's).
    """
    global _folded
    before = window_peak_mb()
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    if not math.isnan(before):
        _folded = max(_folded, before)
    return True


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB: the largest ``VmHWM`` over every window where there is
    one (``exec`` resets it), else ``getrusage``'s ``ru_maxrss`` (which on Linux also counts the parent's pages a
    forked child had before ``exec``); NaN where neither exists."""
    peak = window_peak_mb()
    if not math.isnan(peak):
        return max(peak, _folded)
    try:
        import resource
        import sys
    except ImportError:  # not a Unix
        return float("nan")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def machine_memory_bytes() -> int | None:
    """The memory this process may use, in bytes: the machine's physical memory, or a cgroup's (a container's)
    limit when lower (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``); None where neither can be read."""
    try:
        total: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        total = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and (total is None or int(text) < total):
            total = int(text)
    return total if total and total > 0 else None


def device_memory_bytes(device: object) -> int | None:
    """The memory tensors on ``device`` may use, in bytes: a CUDA device's total memory, else
    ``machine_memory_bytes`` (None: unknown)."""
    if str(device).startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(str(device))).total_memory)
    return machine_memory_bytes()
