"""A tiny causal transformer policy that learns on a CPU (char-level tokenizer, optional value head).

The model is a few-layer pre-norm transformer (default d=128, 3 layers, 4 heads: about 0.6 M parameters) over a
character vocabulary (PAD, BOS, EOS + the task's alphabet). It implements ``sara.policies.base.Policy`` (token
log-probs of given tokens, entropy, values, parameters, state_dict) and adds ``sample``: batched generation with
per-row seeds, used by ``sara.envs.backends.tiny.TinyBackend``.

``warm_start`` trains it supervised on a task's prompts and reference answers to partial competence, so prompt
difficulty is heterogeneous (some always right, some never, many in between), the regime where rollout allocation
matters. ``make_tiny_policy`` caches the warm-started weights under ``$SARA_CACHE_DIR`` (default ``~/.cache/sara``)
keyed by every setting that changes them, so tests and runs reuse them.

Shapes in this module: ``B`` sequences, ``T`` positions, ``V`` vocabulary size, ``D`` model width.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, field_validator
from torch import nn

from sara.checkpoint import file_lock
from sara.config import SaraModel
from sara.policies.base import TokenBatch
from sara.seeding import uniform_from_seeds
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
]

PAD, BOS, EOS = 0, 1, 2


def cache_dir() -> Path:
    """Where warm-started weights are cached: ``$SARA_CACHE_DIR`` or ``~/.cache/sara``."""
    return Path(os.environ.get("SARA_CACHE_DIR") or Path.home() / ".cache" / "sara")


class CharTokenizer:
    """One token per character of ``alphabet``, after three specials: PAD=0, BOS=1, EOS=2.

    Args:
        alphabet: The characters the model reads and writes (no duplicates).
    """

    pad_token_id = PAD
    bos_token_id = BOS
    eos_token_id = EOS

    def __init__(self, alphabet: str) -> None:
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"alphabet must be non-empty without duplicates, got {alphabet!r}")
        self.alphabet = alphabet
        self._index = {c: i + 3 for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet) + 3

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``; raises ``ValueError`` naming a character outside the alphabet."""
        try:
            ids = [self._index[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}") from None
        return [BOS] * bos + ids + [EOS] * eos

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, stopping at the first EOS and skipping PAD/BOS."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS:
                break
            if i >= 3:
                out.append(self.alphabet[i - 3])
        return "".join(out)


class TinyConfig(SaraModel):
    """Architecture of the tiny policy."""

    alphabet: str = "0123456789+-="
    """Characters of the vocabulary (PAD, BOS, EOS are added)."""
    d_model: int = Field(128, ge=8)
    """Model width."""
    n_layers: int = Field(3, ge=1)
    """Transformer blocks."""
    n_heads: int = Field(4, ge=1)
    """Attention heads (must divide d_model)."""
    max_len: int = Field(32, ge=4)
    """Maximum sequence length (BOS + prompt + completion)."""
    value_head: bool = False
    """Add a scalar value head (PPO's critic) on the final hidden state."""
    init_seed: int = 0
    """Seed of the weight initialisation."""
    digit_places: bool = True
    """Add "digit place" embeddings (Abacus-style): each prompt digit gets its place counted from the right of its
    number (units, tens, ...), each completion token its offset after the prompt's first ``=``. Computed from the
    token ids (causal: a completion token's feature never depends on later tokens). A strong inductive bias for
    arithmetic; no effect when the alphabet has no ``=``."""

    @field_validator("n_heads")
    @classmethod
    def _heads_divide(cls, v: int, info: Any) -> int:
        d = info.data.get("d_model")
        if d is not None and d % v:
            raise ValueError(f"n_heads ({v}) must divide d_model ({d})")
        return v


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # Causal attention only: sequences are right-padded, so a real position never sees a pad.
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyPolicy(nn.Module):
    """A small pre-norm causal transformer language policy (implements ``sara.policies.base.Policy``)."""

    def __init__(self, config: TinyConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__()
        cfg = config if isinstance(config, TinyConfig) else TinyConfig.model_validate(dict(config or {}))
        self.config = cfg
        self.tokenizer = CharTokenizer(cfg.alphabet)
        v, d = self.tokenizer.vocab_size, cfg.d_model
        gen = torch.Generator().manual_seed(cfg.init_seed)
        self.tok = nn.Embedding(v, d)
        self.pos = nn.Embedding(cfg.max_len, d)
        self.blocks = nn.ModuleList(_Block(d, cfg.n_heads) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, v, bias=False)
        self.value = nn.Linear(d, 1) if cfg.value_head else None
        self.places: nn.Embedding | None = None
        if cfg.digit_places and "=" in cfg.alphabet:
            self.places = nn.Embedding(2 * cfg.max_len + 2, d)  # 0: none, 1..: prompt-digit place, then answer offset
            digit = torch.zeros(v, dtype=torch.bool)
            for c in "0123456789":
                if c in cfg.alphabet:
                    digit[self.tokenizer.encode(c)[0]] = True
            self.register_buffer("_is_digit", digit, persistent=False)
            self._eq_id = self.tokenizer.encode("=")[0]
        for name, p in self.named_parameters():  # deterministic init from init_seed, independent of global RNG
            with torch.no_grad():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                elif name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()
        if self.value is not None:
            nn.init.zeros_(self.value.weight)

    @property
    def has_value_head(self) -> bool:  # type: ignore[override]
        return self.value is not None

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[B, T, D]`` of ``input_ids [B, T]``."""
        t = input_ids.shape[1]
        if t > self.config.max_len:
            raise ValueError(f"sequence length {t} exceeds the policy's max_len {self.config.max_len}")
        x = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        if self.places is not None:
            x = x + self.places(self._place_ids(input_ids))
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x)

    def _place_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` place index: 1 + place-from-right of a prompt digit, ``max_len + 1 + offset`` for tokens after
        the first ``=`` (offset 0 = first completion token), 0 otherwise."""
        b, t = ids.shape
        ml = self.config.max_len
        is_eq = ids == self._eq_id
        pos = torch.arange(t, device=ids.device).expand(b, t)
        eq_at = torch.where(is_eq.any(1), is_eq.int().argmax(1), torch.full((b,), t, device=ids.device))
        in_prompt = pos < eq_at[:, None]
        digit = self._is_digit[ids] & in_prompt
        place = torch.zeros(b, t, dtype=torch.long, device=ids.device)
        run = torch.zeros(b, dtype=torch.long, device=ids.device)
        for j in range(t - 1, -1, -1):  # digits to the right within the same number (prompt only: no leak)
            run = torch.where(digit[:, j], run + 1, torch.zeros_like(run))
            place[:, j] = run
        after = pos > eq_at[:, None]
        return torch.where(after, ml + 1 + (pos - eq_at[:, None] - 1).clamp(max=ml), place.clamp(max=ml))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, V]``: ``logits[:, t]`` predicts ``input_ids[:, t + 1]``."""
        return self.head(self.hidden(input_ids))

    # ---- Policy protocol ------------------------------------------------------------------------------------
    def token_logprobs(self, batch: TokenBatch, *, with_entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs [B, T], entropy [B, T] or None)``: log p(input_ids[t] | input_ids[:t]); position 0 is 0."""
        ids = batch.input_ids
        logits = self(ids)[:, :-1].float()
        logp_all = torch.log_softmax(logits, dim=-1)
        lp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        zero = lp.new_zeros(ids.shape[0], 1)
        out = torch.cat([zero, lp], dim=1)
        ent = None
        if with_entropy:
            e = -(logp_all.exp() * logp_all).sum(-1)
            ent = torch.cat([zero, e], dim=1)
        return out, ent

    def values(self, batch: TokenBatch) -> torch.Tensor:
        """Value estimates ``[B, T]``: ``values[:, t]`` is the value of the state before token ``t`` is emitted
        (computed from the hidden state at ``t - 1``; position 0 is 0), aligned with ``token_logprobs``."""
        if self.value is None:
            raise RuntimeError("this TinyPolicy has no value head (TinyConfig.value_head=False)")
        h = self.hidden(batch.input_ids)[:, :-1]
        v = self.value(h).squeeze(-1).float()
        return torch.cat([v.new_zeros(v.shape[0], 1), v], dim=1)

    # ---- generation -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompt_ids: Sequence[Sequence[int]], seeds: Sequence[int], *, temperature: float = 1.0,
               top_p: float = 1.0, max_new_tokens: int = 16) -> list[tuple[list[int], list[float], str]]:
        """Sample one completion per row; row ``i`` uses only ``seeds[i]`` (batch-independent draws).

        Rows are bucketed by prompt length (no padding, so a row's logits do not depend on its batch-mates), and
        token ``t`` of row ``i`` is drawn by inverting the CDF of ``softmax(logits / temperature)`` at
        ``uniform_from_seeds(seeds[i], stream=t)``. ``temperature <= 0`` is greedy.

        Args:
            prompt_ids: Token ids of each prompt, BOS included.
            seeds: One seed per row.
            temperature: Softmax temperature (1.0 = the policy's own distribution).
            top_p: Nucleus mass: keep the most likely tokens whose cumulative probability reaches ``top_p`` and
                renormalize (1.0 = off).
            max_new_tokens: Cap on generated tokens (further capped by ``max_len``).

        Returns:
            Per row ``(token_ids, logprobs, finish_reason)``: generated ids (EOS included when emitted), their
            log-probs under the sampling distribution (``logits / temperature``; greedy: temperature 1), and
            ``"stop"`` or ``"length"``.
        """
        if len(prompt_ids) != len(seeds):
            raise ValueError("one seed per prompt is required")
        out: list[tuple[list[int], list[float], str]] = [([], [], "length")] * len(prompt_ids)
        buckets: dict[int, list[int]] = {}
        for i, p in enumerate(prompt_ids):
            buckets.setdefault(len(p), []).append(i)
        seeds_arr = np.asarray([int(s) for s in seeds], dtype=np.uint64)
        dev = self.device
        was_training = self.training
        self.eval()
        try:
            for plen, rows in sorted(buckets.items()):
                steps = min(max_new_tokens, self.config.max_len - plen)
                if steps <= 0:
                    raise ValueError(f"prompt of {plen} tokens leaves no room under max_len {self.config.max_len}")
                ids = torch.tensor([list(prompt_ids[i]) for i in rows], dtype=torch.long, device=dev)
                u = np.stack([uniform_from_seeds(seeds_arr[rows], stream=t) for t in range(steps)], axis=1)
                u_t = torch.as_tensor(u, dtype=torch.float64, device=dev)
                toks, lps = [], []
                done = torch.zeros(len(rows), dtype=torch.bool, device=dev)
                for t in range(steps):
                    logits = self(ids)[:, -1].double()
                    if temperature > 0:
                        logp = torch.log_softmax(logits / temperature, dim=-1)
                        if top_p < 1.0:
                            logp = _nucleus(logp, top_p)
                        cdf = logp.exp().cumsum(-1)
                        nxt = torch.searchsorted(cdf, (u_t[:, t] * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
                        nxt = nxt.clamp_(max=logits.shape[-1] - 1)
                    else:
                        logp = torch.log_softmax(logits, dim=-1)
                        nxt = logp.argmax(-1)
                    nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
                    toks.append(nxt)
                    lps.append(logp.gather(-1, nxt[:, None]).squeeze(-1))
                    done |= nxt == EOS
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                    if bool(done.all()):
                        break
                tok_m = torch.stack(toks, 1).tolist()
                lp_m = torch.stack(lps, 1).tolist()
                for r, i in enumerate(rows):
                    ti, li = tok_m[r], lp_m[r]
                    if EOS in ti:
                        n = ti.index(EOS) + 1
                        out[i] = (ti[:n], [float(x) for x in li[:n]], "stop")
                    else:
                        out[i] = (ti, [float(x) for x in li], "length")
        finally:
            self.train(was_training)
        return out


def _nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalized log-probs ``[B, V]`` restricted to the smallest top set with mass >= ``top_p``."""
    sorted_lp, order = logp.sort(-1, descending=True)
    before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass strictly above each token
    drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, before >= top_p)
    kept = logp.masked_fill(drop, float("-inf"))
    return kept - torch.logsumexp(kept, -1, keepdim=True)


# ---- supervised warm start ----------------------------------------------------------------------------------------
class WarmStartConfig(SaraModel):
    """Supervised warm start to partial competence (teacher forcing on reference answers)."""

    steps: int = Field(600, ge=0)
    """Optimizer steps (0 = no warm start, a random policy)."""
    batch_size: int = Field(128, ge=1)
    """Sequences per step."""
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
    """Teacher-force ``BOS + prompt + target + EOS`` with the loss on the target and EOS only.

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
    return losses


def _atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
        if cache and path.exists():
            state = torch.load(path, map_location="cpu", weights_only=True)
            policy.load_state_dict(state["model"])
            return
        t0 = time.perf_counter()
        if verbose:
            print(f"warm-starting the tiny policy ({ws.steps} supervised steps; cached afterwards at {path})",
                  flush=True)
        losses = warm_start(policy, prompts, ws)
        if verbose:
            print(f"warm start done in {time.perf_counter() - t0:.0f} s (final loss {losses[-1]:.3f})", flush=True)
        if cache:
            _atomic_torch_save({"model": policy.state_dict(), "meta": json.loads(blob)}, path)


def num_parameters(module: nn.Module) -> int:
    """Trainable parameter count."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)

