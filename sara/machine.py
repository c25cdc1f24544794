"""The machine a run computes on: the CPU (its model and the instruction sets that decide how fast bfloat16 is),
cores, threads, torch, an accelerator if any; and the one probe every ``auto`` dtype resolves through.

A CPU multiplies bfloat16 natively when it has AVX512-BF16 or AMX *and* oneDNN (torch's CPU matmul library) may
use them: ``ONEDNN_MAX_CPU_ISA`` below ``AVX512_CORE_BF16`` keeps oneDNN off those instructions, so a run under it
computes as a CPU without them would. Elsewhere (no native bfloat16) a bfloat16 matmul is emulated and runs many
times slower than float32, so ``auto`` picks float32 there; docs/results.md has the measured ratios.

torch is imported inside the functions that need it, so this module stays importable without it.
"""

from __future__ import annotations

import os
import platform
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

# CPU flags (as /proc/cpuinfo spells them) that decide the speed of a dtype; a run's metadata keeps these.
DTYPE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_fp16")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# oneDNN's ISA names in increasing order (ONEDNN_MAX_CPU_ISA); bfloat16 is native from AVX512_CORE_BF16 on.
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
               "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
               "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")
_FIRST_BF16_ISA = ONEDNN_ISAS.index("AVX512_CORE_BF16")
ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")

DtypeName = Literal["float32", "bfloat16", "float16"]
DtypeWant = Literal["auto", "float32", "bfloat16", "float16"]


@lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in ``/proc/cpuinfo``; ("", empty) where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return "", frozenset()
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if model and flags:
            break
    return model, flags


def cpu_model() -> str:
    """The CPU's model name (``platform.processor()`` where ``/proc/cpuinfo`` is missing)."""
    return _cpuinfo()[0] or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` spells them (empty where it is missing)."""
    return _cpuinfo()[1]


def _torch_cpu_bf16() -> bool:
    """torch's own CPU probes, for a machine without ``/proc/cpuinfo`` (private names: absent in some builds)."""
    import torch

    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(bool(f()) for f in probes if f is not None)


def cpu_bf16() -> tuple[bool, str]:
    """Whether this CPU multiplies bfloat16 natively, and why, in words fit for a run's first lines."""
    flags = cpu_flags()
    have = [f for f in BF16_FLAGS if f in flags] if flags else (["bf16"] if _torch_cpu_bf16() else [])
    if not have:
        return False, "this CPU has no native bfloat16 (neither AVX512-BF16 nor AMX)"
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    if cap in ONEDNN_ISAS and ONEDNN_ISAS.index(cap) < _FIRST_BF16_ISA:
        return False, f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN off this CPU's bfloat16 instructions"
    return True, f"this CPU multiplies bfloat16 natively ({', '.join(f.upper() for f in have)})"


def bf16_native(device: str = "cpu") -> tuple[bool, str]:
    """Whether ``device`` (``cpu``, ``cuda``, ``cuda:1``, ...) multiplies bfloat16 natively, and why."""
    kind = str(device).split(":", 1)[0]
    if kind == "cpu":
        return cpu_bf16()
    if kind == "cuda":
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return True, "this GPU multiplies bfloat16 natively"
        return False, "this GPU has no native bfloat16"
    return False, f"no bfloat16 probe for device {kind!r}"


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved dtype and the reason for it (what a run prints and records)."""

    name: DtypeName
    reason: str

    def line(self, what: str) -> str:
        """E.g. ``generation: float32 (this CPU has no native bfloat16 ...)``."""
        return f"{what}: {self.name} ({self.reason})"


def weights_choice(module: object, choice: DtypeChoice | None, other: str) -> DtypeChoice:
    """What a torch ``module`` computes in: ``choice`` when its weights are in that dtype, else (or with no
    ``choice``) their own dtype with the reason ``other`` (a module handed in as it is)."""
    actual = str(next(module.parameters()).dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    return choice if choice is not None and actual == choice.name else DtypeChoice(actual, other)  # type: ignore[arg-type]


_WARNED: set[str] = set()


def resolve_dtype(want: DtypeWant, device: str = "cpu") -> DtypeChoice:
    """Resolve ``auto`` by the device: bfloat16 where it multiplies bfloat16 natively, else float32.

    An explicit dtype is kept (its reason says so, and for bfloat16 whether the device has it natively); forcing
    bfloat16 on a device without it warns once per device kind (``RuntimeWarning``) with the expected slowdown.
    """
    native, why = bf16_native(device)
    if want == "auto":
        return DtypeChoice("bfloat16" if native else "float32", why)
    if want == "bfloat16" and not native:
        kind = str(device).split(":", 1)[0]
        if kind not in _WARNED:
            _WARNED.add(kind)
            warnings.warn(f"bfloat16 was asked for on {device}, but {why}: expect its matmuls many times slower "
                          "than float32 (generation about 2x slower, the learner's matmuls up to ~36x; see "
                          "docs/results.md); use 'auto' or 'float32'", RuntimeWarning, stacklevel=2)
    if want == "bfloat16":
        return DtypeChoice("bfloat16", f"as asked; {why}")
    return DtypeChoice(want, "as asked")


def machine_info(device: str = "cpu") -> dict[str, object]:
    """What a run's metadata records about the machine: JSON-ready, small, no secrets (no host name).

    Keys: ``cpu`` (model), ``cpu_flags`` (the dtype-relevant flags it has), ``cores`` (logical CPUs), ``usable_cores``
    (this process's affinity), ``threads`` (torch's intra-op threads, when torch is installed), ``torch``,
    ``python``, ``platform``, ``bf16_native`` / ``bf16_reason`` (for ``device``), ``isa_limits`` (the
    ``ONEDNN_MAX_CPU_ISA`` / ``ATEN_CPU_CAPABILITY`` set), ``gpu`` (the CUDA device's name, when ``device`` is one).
    """
    flags = cpu_flags()
    native, why = bf16_native(device)
    out: dict[str, object] = {
        "cpu": cpu_model(),
        "cpu_flags": [f for f in DTYPE_FLAGS if f in flags],
        "cores": os.cpu_count() or 1,
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "bf16_native": native,
        "bf16_reason": why,
        "isa_limits": {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)},
    }
    try:
        import torch
    except ImportError:
        return out
    out["torch"] = torch.__version__
    out["threads"] = torch.get_num_threads()
    if str(device).startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def machine_kind(info: dict[str, object]) -> str:
    """A short label that tells machine kinds apart in a report, e.g. ``Intel Xeon, bf16 native, 2 cores``.

    Args:
        info: A ``machine_info`` dict (possibly read back from a results file).
    """
    cpu = str(info.get("cpu") or "unknown CPU")
    for noise in ("(R)", "(TM)", "(tm)", " Processor", " CPU"):
        cpu = cpu.replace(noise, "")
    cpu = " ".join(cpu.split())
    if info.get("gpu"):
        cpu = f"{info['gpu']} (host {cpu})"
    bf16 = "bf16 native" if info.get("bf16_native") else "no native bf16"
    limits = info.get("isa_limits") or {}
    extra = f", {', '.join(f'{k}={v}' for k, v in sorted(dict(limits).items()))}" if limits else ""
    return f"{cpu}, {bf16}, {info.get('usable_cores', info.get('cores', '?'))} cores{extra}"
