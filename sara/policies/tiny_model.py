"""The tiny causal transformer policy: char-level tokenizer, architecture config, network and batched sampling.

A few-layer pre-norm transformer (default d=128, 3 layers, 4 heads: about 0.6 M parameters) over a character vocabulary
(PAD, BOS, EOS + the task's alphabet). It implements ``sara.policies.base.Policy`` (``score``: token log-probs of given
tokens, entropy, values in one forward pass) and adds ``sample``: batched generation with per-row seeds, used by the
tiny generation backend. The supervised warm start and the weight cache live in ``sara.policies.tiny``.

Shapes in this module: ``B`` sequences, ``T`` positions, ``V`` vocabulary size, ``D`` model width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator
from torch import nn

from sara.config import MAX_SEED, SaraModel
from sara.policies.base import PolicyOutput, ScoreViews, TokenBatch
from sara.seeding import uniform_from_seeds

__all__ = ["CharTokenizer", "MAX_TINY_PARAMETERS", "TinyConfig", "TinyPolicy", "PAD", "BOS", "EOS", "num_parameters"]

PAD, BOS, EOS = 0, 1, 2
MAX_TINY_PARAMETERS = 2**28
"""Most parameters a ``TinyConfig`` may ask for (268 M: 1 GiB of float32 weights, four times that with gradients and
AdamW's moments), checked before any weight is allocated."""


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
    d_model: int = Field(128, ge=8, le=8192)
    """Model width, at most 8192."""
    n_layers: int = Field(3, ge=1, le=256)
    """Transformer blocks, at most 256."""
    n_heads: int = Field(4, ge=1, le=1024)
    """Attention heads (must divide d_model), at most 1024."""
    max_len: int = Field(32, ge=4, le=4096)
    """Maximum sequence length (BOS + prompt + completion), at most 4096."""
    value_head: bool = False
    """Add a scalar value head (PPO's critic) on the final hidden state."""
    init_seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the weight initialisation, in [0, ``sara.config.MAX_SEED``]."""
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

    @model_validator(mode="after")
    def _fits(self) -> TinyConfig:
        n = self.parameter_count()
        if n > MAX_TINY_PARAMETERS:
            raise ValueError(f"field 'd_model': d_model={self.d_model}, n_layers={self.n_layers}, max_len="
                             f"{self.max_len} and {len(self.alphabet)} characters make {n:,} parameters, more than "
                             f"{MAX_TINY_PARAMETERS:,}; lower d_model or n_layers")
        return self

    def parameter_count(self) -> int:
        """Parameters of the network this config describes (value head included), counted without building it."""
        v, d, t = len(self.alphabet) + 3, self.d_model, self.max_len
        places = (2 * t + 2) * d if self.digit_places and "=" in self.alphabet else 0
        blocks = self.n_layers * (12 * d * d + 13 * d)  # two LayerNorms, qkv, proj, a 4x MLP
        return 2 * v * d + t * d + blocks + 2 * d + (d + 1) * self.value_head + places


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


class TinyPolicy(ScoreViews, nn.Module):
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
    def score(self, batch: TokenBatch, *, with_entropy: bool = False, with_values: bool = False) -> PolicyOutput:
        """One forward pass -> ``PolicyOutput`` (log-probs; entropy / values when asked), all ``[B, T]``."""
        if with_values and self.value is None:
            raise RuntimeError("this TinyPolicy has no value head (TinyConfig.value_head=False)")
        ids = batch.input_ids
        h = self.hidden(ids)
        logp_all = torch.log_softmax(self.head(h)[:, :-1].float(), dim=-1)
        lp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
        zero = lp.new_zeros(ids.shape[0], 1)
        ent = torch.cat([zero, -(logp_all.exp() * logp_all).sum(-1)], dim=1) if with_entropy else None
        values = torch.cat([zero, self.value(h[:, :-1]).squeeze(-1).float()], dim=1) if with_values else None
        return PolicyOutput(torch.cat([zero, lp], dim=1), ent, values)

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
                    nxt, logp = self.draw(ids, u_t[:, t], temperature=temperature, top_p=top_p)
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

    @torch.no_grad()
    def draw(self, ids: torch.Tensor, u: torch.Tensor, *, temperature: float = 1.0,
             top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``sample`` for rows of equal length: the next token of each row of ``ids [B, T]`` by
        inverting the CDF at ``u [B]`` (float64 uniforms; ignored when ``temperature <= 0``: greedy).

        Returns:
            ``(tokens [B], logp [B, V])``: the drawn ids and the sampling distribution's log-probs (float64).
        """
        logits = self(ids)[:, -1].double()
        if temperature > 0:
            logp = torch.log_softmax(logits / temperature, dim=-1)
            if top_p < 1.0:
                logp = _nucleus(logp, top_p)
            cdf = logp.exp().cumsum(-1)
            nxt = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
            return nxt.clamp_(max=logits.shape[-1] - 1), logp
        logp = torch.log_softmax(logits, dim=-1)
        return logp.argmax(-1), logp


def _nucleus(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalized log-probs ``[B, V]`` restricted to the smallest top set with mass >= ``top_p``."""
    sorted_lp, order = logp.sort(-1, descending=True)
    before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()  # mass strictly above each token
    drop = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, before >= top_p)
    kept = logp.masked_fill(drop, float("-inf"))
    return kept - torch.logsumexp(kept, -1, keepdim=True)


def num_parameters(module: nn.Module) -> int:
    """Trainable parameter count."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)

