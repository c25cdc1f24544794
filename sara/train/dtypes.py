"""The dtypes a run computes in, resolved from its config before anything is built, and the machine it runs on.

``run_dtypes(cfg)`` answers for the generating copy (``generation``) and the learner's matmuls (``learner``) what
the built components will use: the HF policy's ``compute_dtype`` and the HF / vLLM backends' ``dtype`` resolve
``auto`` through ``sara.machine.resolve_dtype`` (bfloat16 where the device multiplies it natively, else float32),
through the same config methods the components call when they are built (``HFPolicyConfig.compute_choice``,
``HFBackendConfig.dtype_choice``, ``VLLMBackendConfig.dtype_choice``). The tiny policy and backend compute in
float32; a factory named ``"module:attr"`` chooses its own dtype (not listed). Ray workers build the backend from the
same options, so they resolve the same on a machine of the same kind.

``run_microbatch(cfg)`` answers the same way for the learner's micro-batch budget (``optim.microbatch_tokens``,
``auto`` sized from the model's shape read from its ``config.json`` and this machine's memory, as the built learner
sizes it from the loaded model: ``sara.train.microbatch.microbatch_budget``).

``run_kv_cache(cfg)`` is the HF backend's KV-cache budget (``backend_options.kv_cache_gib``) resolved the same way.

``sara train`` prints these lines first (and ``--print-config`` as YAML comments); ``run_machine(cfg)`` is what a
run's summary records under ``machine`` (``RunSummary.machine``: ``sara train --json``, ``sara matrix``'s
``result.json``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sara.config import validate_config
from sara.machine import DtypeChoice, machine_info, machine_kind

if TYPE_CHECKING:
    from sara.train.config import TrainConfig

__all__ = ["dtype_lines", "run_dtypes", "run_kv_cache", "run_machine", "run_microbatch"]

_POLICY_CONFIGS = {"hf": ("sara.policies.hf", "HFPolicyConfig")}
"""Policy factories whose options decide the learner's dtype: factory name -> (module, config class)."""
_BACKEND_CONFIGS = {"hf": ("sara.backends.hf", "HFBackendConfig"), "vllm": ("sara.backends.vllm", "VLLMBackendConfig")}
"""Backend factories whose options decide the generating dtype."""
_TINY = DtypeChoice("float32", "the tiny transformer computes in float32")


def _config(table: dict[str, tuple[str, str]], name: str, options: dict[str, Any], what: str) -> Any:
    import importlib

    module, cls = table[name]
    return validate_config(getattr(importlib.import_module(module), cls), options, what=what)


def run_dtypes(cfg: TrainConfig) -> dict[str, DtypeChoice]:
    """``{"generation": ..., "learner": ...}`` of a ``TrainConfig`` on this machine (a component whose dtype its
    factory chooses is left out). Forcing bfloat16 where it is not native warns once (``RuntimeWarning``).

    Raises:
        ConfigError: invalid policy or backend options (as the factory would raise them).
    """
    out: dict[str, DtypeChoice] = {}
    policy_name, policy_options = cfg.component("policy")
    backend_name, backend_options = cfg.component("backend")
    policy = None
    if policy_name in _POLICY_CONFIGS:
        policy = _config(_POLICY_CONFIGS, policy_name, policy_options, f"policy '{policy_name}'")
        learner = policy.compute_choice()
    elif policy_name == "tiny":
        learner = _TINY
    else:
        learner = None
    if backend_name in _BACKEND_CONFIGS:
        backend = _config(_BACKEND_CONFIGS, backend_name, backend_options, f"backend '{backend_name}'")
        if getattr(backend, "share_policy", False) and policy is not None:
            out["generation"] = DtypeChoice(policy.dtype, "the policy's own module (share_policy)")
        else:
            out["generation"] = backend.dtype_choice()
    elif backend_name == "tiny":
        out["generation"] = _TINY
    if learner is not None:
        out["learner"] = learner
    return out


def run_microbatch(cfg: TrainConfig) -> tuple[int | None, str]:
    """``(positions or None, reason)`` the learner's micro-batch budget resolves to on this machine, before anything
    is built (``auto`` with a policy whose activations are unknown here, e.g. a named model not prepared yet: the
    fallback, and the reason says it is resolved when the model loads)."""
    from sara.memory import device_memory_bytes
    from sara.train.microbatch import microbatch_budget

    want = cfg.optim.microbatch_tokens
    policy_name, policy_options = cfg.component("policy")
    per_token = None
    if want == "auto" and policy_name in _POLICY_CONFIGS:
        policy = _config(_POLICY_CONFIGS, policy_name, policy_options, f"policy '{policy_name}'")
        per_token = policy.activation_bytes_per_token()
        if per_token is None:
            return None, "auto: sized when the model loads (its config.json is not on this machine yet)"
    return microbatch_budget(want, per_token, device_memory_bytes(policy_options.get("device", "cpu")))


def run_kv_cache(cfg: TrainConfig) -> str | None:
    """The line the HF backend's KV-cache budget (``backend_options.kv_cache_gib``) resolves to on this machine,
    from the model's ``config.json`` (``sara.backends.hf_budget``); None for a backend without one."""
    backend_name, backend_options = cfg.component("backend")
    if backend_name != "hf":
        return None
    backend = _config(_BACKEND_CONFIGS, backend_name, backend_options, f"backend '{backend_name}'")
    return str(backend.kv_budget(dtype=run_dtypes(cfg)["generation"].name).line())


def dtype_lines(choices: dict[str, DtypeChoice]) -> list[str]:
    """``["generation: float32 (this CPU has no native bfloat16 ...)", "learner: ..."]``."""
    return [choice.line(what) for what, choice in choices.items()]


def run_machine(cfg: TrainConfig, choices: dict[str, DtypeChoice] | None = None) -> dict[str, Any]:
    """What a run records about where it ran: ``sara.machine.machine_info`` of the policy's device, its
    ``machine_kind`` label under ``kind``, and ``dtypes`` (``{"generation": {"dtype", "reason"}, "learner": ...}``).

    Args:
        cfg: The run's ``TrainConfig``.
        choices: ``run_dtypes(cfg)`` when already resolved.
    """
    device = str(cfg.component("policy")[1].get("device", "cpu"))
    info: dict[str, Any] = dict(machine_info(device))
    info["kind"] = machine_kind(info)
    choices = run_dtypes(cfg) if choices is None else choices
    info["dtypes"] = {what: {"dtype": c.name, "reason": c.reason} for what, c in choices.items()}
    return info
