"""Trainable policies, selected by name.

``POLICIES`` is a registry of factories, so the trainer never branches on a model family:
``factory(options: dict, *, task, seed) -> Policy`` (``sara.policies.base.Policy``). ``"tiny"`` builds the tiny
transformer and warm-starts it on the task (cached on disk). The generation backends that serve a policy have their
own registry, ``sara.backends.BACKENDS`` (backends may import policies; policies never import backends).

Entries are ``"module:attr"`` strings imported on first use, so ``import sara.policies`` never imports torch. A config
may also name an unregistered ``"package.module:factory"`` directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sara.policies.base import Policy, PolicyOutput, TokenBatch
from sara.registry import Registry, returns

__all__ = ["POLICIES", "Policy", "PolicyOutput", "TokenBatch", "make_tiny_policy_for_task"]

POLICIES: Registry[Callable[..., Any]] = Registry(
    "policy", accepts=returns(Policy), expects="a function annotated to return a sara.policies.base.Policy",
    signature="(options, *, task, seed, verbose)")
"""Policy name -> ``factory(options, *, task, seed) -> Policy``."""

POLICIES.register("tiny", "sara.policies:make_tiny_policy_for_task")
# Real LLMs: any local HF model directory or a prepared name (``sara model prepare smollm2``).
POLICIES.register("hf", "sara.policies.hf:make_hf_policy")


def make_tiny_policy_for_task(options: dict[str, Any] | None = None, *, task: Any, seed: int = 0,
                              verbose: bool = False, **_: Any) -> Any:
    """``POLICIES["tiny"]``: a tiny transformer warm-started on ``task.prompts`` (weights cached on disk).

    Args:
        options: ``TinyConfig`` fields, plus ``warm_start`` (``WarmStartConfig`` fields) and ``cache`` (bool).
        task: A ``sara.envs.tasks.Task`` with text prompts whose answers have an ``"answer"`` field.
        seed: Not used for the weights (the init and warm-start seeds are options), so every algorithm x allocator
            cell of a matrix starts from the same policy.
        verbose: Print when warm-starting.
    """
    from sara.policies.tiny import make_tiny_policy

    opts = dict(options or {})
    cache = bool(opts.pop("cache", True))
    alphabet = (getattr(task, "metadata", {}) or {}).get("alphabet")
    if alphabet and "alphabet" not in opts:
        opts["alphabet"] = alphabet
    _check_readable(task, opts.get("alphabet"))
    key = f"{task.id}:{(getattr(task, 'metadata', {}) or {}).get('config')}"
    return make_tiny_policy(opts, prompts=task.prompts, cache_key=key, cache=cache, verbose=verbose)


def _check_readable(task: Any, alphabet: str | None) -> None:
    """A ``ConfigError`` when the tiny policy cannot read ``task``: chat prompts, or characters outside its alphabet
    in a prompt or a reference answer (the message names the ``alphabet`` metadata key to declare)."""
    from sara.config import ConfigError
    from sara.policies.tiny_model import TinyConfig

    fix = "use policy=hf:model=smollm2 with backend=hf (sara model prepare smollm2), or a task the tiny policy reads"
    if getattr(task, "chat", False):
        raise ConfigError(f"policy 'tiny': task {task.id!r} renders chat messages and the tiny policy reads plain "
                          f"text; {fix}")
    chars = set(alphabet or TinyConfig.model_fields["alphabet"].default)
    texts = [(p, what, text) for p in [*task.prompts, *task.eval_prompts]
             for what, text in (("prompt", task.render(p)), ("answer", (p.answer or {}).get("answer")))
             if isinstance(text, (str, int, float))]
    needed = sorted({c for _, _, text in texts for c in str(text)})
    for p, what, text in texts:
        missing = sorted(set(str(text)) - chars)
        if not missing:
            continue
        shown = "".join(sorted(chars))
        where = (f"policy 'tiny': task {task.id!r} {what} of {p.id!r} has characters outside the tiny policy's "
                 f"alphabet {shown[:80]!r}{' (the default)' if alphabet is None else ''}: {''.join(missing[:10])!r}")
        if alphabet is None:
            declare = "".join(needed[:80]) + ("..." if len(needed) > 80 else "")
            raise ConfigError(f"{where}; declare the characters the task uses in its metadata key 'alphabet', e.g. "
                              f"Task(..., metadata={{'alphabet': {declare!r}}}), or {fix.removeprefix('use ')}")
        raise ConfigError(f"{where}; add them to the alphabet (the task's metadata key 'alphabet' or the policy "
                          f"option alphabet), or {fix.removeprefix('use ')}")
