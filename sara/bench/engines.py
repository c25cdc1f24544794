"""The backends the engine benchmarks run on (``sara bench generation``, ``sara bench stream``), built one way.

``build_backend`` turns a backend spec (``tiny``, ``hf``, ``vllm``, with options) into ``(task, backend, task
spec)``: the tiny policy ``sara train`` starts from for ``tiny``, the prepared ``smollm2`` model for the real
backends (weights fixed: no trainable copy), the engine's capacity set from ``slots`` (``CAPACITY_OPTIONS``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from sara.config import ConfigError, parse_spec

__all__ = ["BACKEND_NAMES", "CAPACITY_OPTIONS", "DEFAULT_TASKS", "build_backend", "check_backend_name",
           "reset_prefix_cache"]

BACKEND_NAMES = ("tiny", "hf", "vllm")
DEFAULT_TASKS = {
    # the tiny policy on the task it is tuned on
    "tiny": "sara/Arithmetic-v0:max_digits=2,ops=+,pool_size=5000",
    # 3-shot 1-digit sums, as in examples/configs/smollm2_*.yaml: SmolLM2-135M solves ~30% at T=1, from ~0% to ~90%
    # per prompt, so SARA has saturated prompts to abandon and mixed ones to commit
    "hf": "sara/Arithmetic-v0:max_digits=1,ops=+,pool_size=80,eval_size=17,shots=3",
    "vllm": "sara/Arithmetic-v0:max_digits=1,ops=+,pool_size=80,eval_size=17,shots=3",
}
CAPACITY_OPTIONS = {"tiny": "max_batch_size", "hf": "max_batch_size"}
"""The backend option ``slots`` sets: the engine's capacity (rows decoded together), which a streaming driver keeps
in flight; vLLM's is ``engine_kwargs.max_num_seqs``."""


def check_backend_name(spec: str) -> str:
    """``spec`` if it names one of ``BACKEND_NAMES`` (a ``ValueError`` naming them otherwise; for validators)."""
    name, _ = parse_spec(spec)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    return spec


def build_backend(spec: str, *, task: str | None = None, slots: int | None = None, seed: int = 0,
                  stream: bool = False, random_init: bool = False,
                  options: Mapping[str, Any] | None = None) -> tuple[Any, Any, str]:
    """``(task, backend, task spec)`` built through the registries.

    Args:
        spec: Backend spec (``tiny``, ``hf:dtype=float32``, ``vllm:engine=async``, ...).
        task: Task spec (None = ``DEFAULT_TASKS[backend]``).
        slots: The engine's capacity (``CAPACITY_OPTIONS``; vLLM: ``engine_kwargs.max_num_seqs``) unless the spec
            sets it; None = the engine's default.
        seed: Seed of the tiny policy's warm start and of the backend.
        stream: The caller streams: vLLM gets its streaming engine (``engine=async``) unless the spec names one.
        random_init: ``hf`` only: the model's architecture with random weights (seeded by ``seed``), for throughput
            measurements that need no trained weights.
        options: Backend options over the spec's own (e.g. ``{"dtype": "float32"}``).

    Raises:
        ConfigError: an unknown backend, or ``random_init`` with another backend than ``hf``.
    """
    from sara.backends import BACKENDS
    from sara.envs.tasks import make_task

    name, parsed = parse_spec(spec)
    options = {**parsed, **(options or {})}
    if name not in BACKEND_NAMES:
        raise ConfigError(f"backend: unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    task_spec = task or DEFAULT_TASKS[name]
    the_task = make_task(task_spec)
    if slots is not None and name in CAPACITY_OPTIONS:
        options.setdefault(CAPACITY_OPTIONS[name], slots)
    elif slots is not None:
        options["engine_kwargs"] = {"max_num_seqs": slots, **options.get("engine_kwargs", {})}
    if name == "vllm" and stream:
        options.setdefault("engine", "async")  # the streaming engine (AsyncLLM); its generate serves rounds
    if random_init:
        if name != "hf":
            raise ConfigError(f"backend: field 'random_init': only the hf backend builds random weights (got {name!r})")
        return the_task, _random_hf(options, seed), task_spec
    if name == "tiny":
        from sara.policies import POLICIES
        from sara.train.config import TINY_POLICY_OPTIONS

        # the policy sara train starts from: its warm start to a loss pins the same competence on any CPU
        policy = POLICIES.get("tiny")(copy.deepcopy(TINY_POLICY_OPTIONS), task=the_task, seed=seed)
    else:  # weights stay fixed: the backend loads the model itself, no trainable copy is needed
        policy = None
        options = {"model": "smollm2", **options}
    return the_task, BACKENDS.get(name)(policy, options, task=the_task, seed=seed), task_spec


def _random_hf(options: dict[str, Any], seed: int) -> Any:
    """An ``HFBackend`` on the architecture of ``options["model"]`` (default ``smollm2``) with random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sara.backends.hf import DTYPES, HFBackend, HFBackendConfig
    from sara.backends.hf_packed import pack_linears
    from sara.config import validate_config
    from sara.hub import resolve_model

    cfg = validate_config(HFBackendConfig, options, what="backend 'hf'")
    path = resolve_model(cfg.model, cfg.cache_dir)
    torch.manual_seed(seed)
    module = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    module = module.to(dtype=DTYPES[cfg.dtype_choice().name], device=cfg.device).eval()
    if cfg.packed_linear:  # the bench's own copy: packed as the engine packs the copies it owns
        pack_linears(module, cfg.max_batch_size)
    return HFBackend(module, AutoTokenizer.from_pretrained(path), **options)


def reset_prefix_cache(backend: Any) -> None:
    """Drop the backend's prompt / prefix cache (``PrefixCached``: hf, vllm), so no measurement reuses KV computed
    by an earlier one."""
    from sara.backends import PrefixCached

    if isinstance(backend, PrefixCached):
        backend.reset_prefix_cache()
