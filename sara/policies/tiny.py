"""The tiny policy for a task: ``make_tiny_policy`` builds a ``TinyPolicy`` and warm-starts it (cached on disk).

``warm_start`` trains it supervised on a task's prompts and reference answers to partial competence, so prompt
difficulty is heterogeneous (some always right, some never, many in between), the regime where rollout allocation
matters. ``make_tiny_policy`` caches the warm-started weights under ``$SARA_CACHE_DIR`` (default ``~/.cache/sara``)
keyed by every setting that changes them, so tests and runs reuse them; an entry is used only when it matches its
checksum and holds this policy's finite tensors (``sara.storage.load_verified``), else it is recomputed. The network
itself is ``sara.policies.tiny_model`` (re-exported here).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from sara.config import SaraModel
from sara.policies.base import TokenBatch
from sara.policies.tiny_model import BOS, EOS, PAD, CharTokenizer, TinyConfig, TinyPolicy, num_parameters
from sara.storage import BadCacheEntry, cache_root, file_lock, load_verified, write_verified
from sara.types import Prompt

__all__ = [
    "CharTokenizer",
    "TinyConfig",
    "TinyPolicy",
    "WarmStartConfig",
    "warm_start",
    "make_tiny_policy",
    "cache_dir",
    "reference_answer",
    "num_parameters",
    "PAD",
    "BOS",
    "EOS",
]


def cache_dir() -> Path:
    """Where warm-started weights are cached: ``sara.storage.cache_root()``."""
    return cache_root()


class WarmStartConfig(SaraModel):
    """Supervised warm start to partial competence (teacher forcing on reference answers)."""

    steps: int = Field(600, ge=0)
    """Optimizer steps (0 = no warm start, a random policy); with ``target_loss``, the most it may take."""
    target_loss: float | None = Field(None, gt=0)
    """Stop as soon as the mean loss of the last ``loss_window`` steps is at most this (None: run all ``steps``).
    It pins the competence reached rather than the step count: the same steps reach very different losses on
    different CPUs (floating-point reduction order changes the trajectory; on this task family one machine needed
    about 600 steps for the loss another reached in 400), so a loss target gives the same starting policy's accuracy
    everywhere, where a step count does not."""
    loss_window: int = Field(25, ge=1)
    """Steps averaged for ``target_loss`` (one step's loss is noisy)."""
    batch_size: int = Field(128, ge=1, le=65_536)
    """Sequences per step, at most 65,536."""
    lr: float = Field(2e-3, gt=0)
    """AdamW learning rate (constant)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the batch order."""


def reference_answer(prompt: Prompt) -> str:
    """The reference completion text of a prompt: ``prompt.answer["answer"]`` as a string.

    Tasks with another answer format pass their own ``target`` function to ``warm_start``.
    """
    if "answer" not in prompt.answer:
        raise ValueError(f"prompt {prompt.id!r} has no 'answer' field to warm-start on; pass target=")
    return str(prompt.answer["answer"])


def warm_start(policy: TinyPolicy, prompts: Sequence[Prompt], config: WarmStartConfig | None = None, *,
               target: Callable[[Prompt], str] = reference_answer,
               on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Teacher-force ``BOS + prompt + target + EOS`` with the loss on the target and EOS only, for ``config.steps``
    steps or until the recent mean loss reaches ``config.target_loss``.

    Args:
        policy: Trained in place.
        prompts: Training prompts (text prompts in the tokenizer alphabet).
        config: Steps, batch size, learning rate, seed.
        target: Reference completion text of a prompt.
        on_step: Optional callback ``(step, loss)``.

    Returns:
        The loss of every step.
    """
    cfg = config or WarmStartConfig()
    tok = policy.tokenizer
    seqs, starts = [], []
    for p in prompts:
        if not isinstance(p.prompt, str):
            raise ValueError("the tiny policy reads text prompts only")
        pre = tok.encode(p.prompt, bos=True)
        seqs.append(pre + tok.encode(target(p), eos=True))
        starts.append(len(pre))
    t_max = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), t_max, dtype=torch.long)
    mask = torch.zeros(len(seqs), t_max)
    for i, (s, st) in enumerate(zip(seqs, starts)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, st : len(s)] = 1.0
    rng = np.random.default_rng(cfg.seed)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    policy.train()
    losses = []
    for step in range(cfg.steps):
        b = torch.as_tensor(rng.integers(0, len(seqs), size=cfg.batch_size))
        x, m = ids[b], mask[b]
        lp, _ = policy.token_logprobs(TokenBatch(x, (x != PAD).float(), m))
        loss = -(lp * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
        if cfg.target_loss is not None and len(losses) >= cfg.loss_window and \
                float(np.mean(losses[-cfg.loss_window:])) <= cfg.target_loss:
            break
    return losses


def make_tiny_policy(options: Mapping[str, Any] | None = None, *, prompts: Sequence[Prompt] = (),
                     cache_key: str = "", cache: bool = True, verbose: bool = False) -> TinyPolicy:
    """Build a tiny policy and warm-start it on ``prompts`` (cached on disk).

    Args:
        options: ``TinyConfig`` fields plus an optional ``warm_start`` mapping of ``WarmStartConfig`` fields.
        prompts: Warm-start prompts (with reference answers); empty = no warm start.
        cache_key: Identifies ``prompts`` in the cache key (e.g. the task spec and pool seed).
        cache: Read/write the warm-started weights under ``cache_dir() / "tiny"``.
        verbose: Print a line when warm-starting.

    Returns:
        The policy in train mode, on CPU.
    """
    from sara.config import validate_config

    opts = dict(options or {})
    ws = validate_config(WarmStartConfig, dict(opts.pop("warm_start", {}) or {}), what="policy 'tiny' warm_start")
    cfg = validate_config(TinyConfig, opts, what="policy 'tiny'")
    # The warm start never touches the value head: warm-start (and cache) without it, then add a fresh one.
    base_cfg = cfg.model_copy(update={"value_head": False})
    policy = TinyPolicy(base_cfg)
    if prompts and ws.steps > 0:
        _warm_start_cached(policy, prompts, ws, cache_key=cache_key, cache=cache, verbose=verbose)
    if not cfg.value_head:
        return policy
    with_value = TinyPolicy(cfg)
    missing, unexpected = with_value.load_state_dict(policy.state_dict(), strict=False)
    if unexpected or any(not k.startswith("value.") for k in missing):
        raise RuntimeError(f"value-head transplant failed: missing {missing}, unexpected {unexpected}")
    return with_value


def _warm_start_cached(policy: TinyPolicy, prompts: Sequence[Prompt], ws: WarmStartConfig, *, cache_key: str,
                       cache: bool, verbose: bool) -> None:
    cfg = policy.config
    blob = json.dumps({"v": 1, "model": cfg.model_dump(), "warm": ws.model_dump(), "data": cache_key,
                       "n": len(prompts), "first": prompts[0].id, "last": prompts[-1].id}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    path = cache_dir() / "tiny" / f"warm-{key}.pt"
    with file_lock(path.with_suffix(".lock")) if cache else contextlib.nullcontext():
        cached = load_verified(path, lambda p: _cached_weights(p, policy)) if cache else None
        if cached is not None:
            policy.load_state_dict(cached)
            return
        t0 = time.perf_counter()
        if verbose:
            goal = f"until the loss reaches {ws.target_loss}, at most {ws.steps} steps" if ws.target_loss else \
                f"{ws.steps} supervised steps"
            print(f"warm-starting the tiny policy ({goal}" + (f"; cached afterwards at {path}" if cache else "")
                  + f"; a progress line every {PROGRESS_EVERY_S:.0f} s)", flush=True)
        losses = warm_start(policy, prompts, ws, on_step=WarmStartProgress(ws) if verbose else None)
        if verbose:
            recent = float(np.mean(losses[-ws.loss_window:]))
            print(f"warm start done in {time.perf_counter() - t0:.0f} s ({len(losses)} steps, final loss "
                  f"{losses[-1]:.3f}, mean of the last {min(ws.loss_window, len(losses))} {recent:.3f})", flush=True)
        if cache:
            buf = io.BytesIO()
            torch.save({"model": policy.state_dict(), "meta": json.loads(blob)}, buf)
            write_verified(path, buf.getvalue())


PROGRESS_EVERY_S = 20.0
"""Seconds between the warm start's progress lines (``make_tiny_policy(verbose=True)``)."""


class WarmStartProgress:
    """``warm_start``'s ``on_step``: every ``PROGRESS_EVERY_S`` seconds a line on stderr with the step, the recent
    mean loss against the target, the seconds so far and the most the remaining steps can take at the pace so far."""

    def __init__(self, ws: WarmStartConfig) -> None:
        self.ws = ws
        self.losses: list[float] = []
        self.t0 = self.last = time.perf_counter()

    def __call__(self, step: int, loss: float) -> None:
        self.losses.append(loss)
        now = time.perf_counter()
        if now - self.last < PROGRESS_EVERY_S:
            return
        self.last, done = now, step + 1
        recent = float(np.mean(self.losses[-self.ws.loss_window:]))
        target = f" (target {self.ws.target_loss})" if self.ws.target_loss else ""
        left = (self.ws.steps - done) * (now - self.t0) / done
        print(f"[warm start] step {done:,} of at most {self.ws.steps:,}: mean loss {recent:.3f}{target}, "
              f"{now - self.t0:.0f} s so far, at most about {left:.0f} s more", file=sys.stderr, flush=True)


def _cached_weights(path: Path, policy: TinyPolicy) -> dict[str, torch.Tensor]:
    """The weights of a warm-start cache entry, checked against ``policy`` before any is loaded into it.

    Raises:
        BadCacheEntry: the entry does not hold this policy's tensors (names, shapes, dtypes), or holds nan / inf.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    weights = state.get("model") if isinstance(state, dict) else None
    expected = policy.state_dict()
    if not isinstance(weights, dict) or set(weights) != set(expected) or any(
            not isinstance(v, torch.Tensor) or v.shape != expected[k].shape or v.dtype != expected[k].dtype
            for k, v in weights.items()):
        raise BadCacheEntry("does not hold this policy's weights (names, shapes or dtypes differ)")
    bad = [k for k, v in weights.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise BadCacheEntry(f"holds non-finite weights ({len(bad)} tensors with nan or inf, e.g. {bad[0]})")
    return weights
