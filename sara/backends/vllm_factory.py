"""The ``vllm`` backend factory (``BACKENDS["vllm"]``): an offline engine (``sara.backends.vllm``) or, with
``engine=async``, a streaming one (``sara.backends.vllm_async``). It sits above both modules, so neither imports the
other's dependant."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sara.backends.vllm import VLLMBackend
from sara.hub import HoldsHFModel

__all__ = ["make_vllm_backend"]


def make_vllm_backend(policy: Any = None, options: Mapping[str, Any] | None = None, **_: Any) -> VLLMBackend:
    """Backend factory for ``BACKENDS["vllm"]``: an engine on ``options["model"]`` (default: the model a
    ``HoldsHFModel`` policy was loaded from, its ``config.model``).

    The engine loads the model from disk; the trainer's ``update_weights`` after each optimizer step keeps it in sync.
    ``engine=async`` gives a ``VLLMAsyncBackend`` (streaming).
    """
    opts = dict(options or {})
    if "model" not in opts and isinstance(policy, HoldsHFModel) and isinstance(policy.config.model, str):
        opts["model"] = policy.config.model
    if opts.get("engine") == "async":
        from sara.backends.vllm_async import VLLMAsyncBackend

        return VLLMAsyncBackend(**opts)
    return VLLMBackend(**opts)
