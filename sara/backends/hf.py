"""HF transformers generation backend: batched sampling with a KV cache on any ``AutoModelForCausalLM`` (CPU or GPU).

One ``generate`` call = one allocation round. Per chunk of rows (``max_batch_size``):

1. every distinct prompt is prefilled ONCE (left padding), and its KV cache is repeated for its ``n`` completions;
   a prompt prefilled in an earlier round under the same weights comes from the prompt-KV cache
   (``sara.backends.hf_prefix``, ``prefix_cache_tokens``): SARA probes the same prompt over several rounds;
   the leading tokens every prompt of the chunk shares (few-shot examples, a system prompt) are prefilled once
   (``sara.backends.hf_shared``, ``shared_prefix_tokens``);
2. a decoding loop samples one token per live row per step; finished rows (EOS, stop string, length cap) are pruned
   from the batch and the cache.

Determinism: every completion has its own seed. The token at position ``t`` of a completion with seed ``s`` is drawn
by inverse-CDF sampling with the uniform number ``u(s, t)`` (``sara.backends.sampling``), so the draws do not
depend on which other rows share the batch or the round. (The logits themselves can differ in the last bits with the
batch shape — bf16 matmul blocking — so equal seeds give equal completions in practice, not bit-for-bit guarantees
across different batch compositions; the same call repeated is exactly reproducible.)

Weight updates mid-call (``SteppedEngine``): ``between_steps``, when set, runs before every chunk and every decode
forward; weights loaded there (from another thread, e.g. a TRL sync) drive the forwards after it, the rows in flight
keeping their tokens and KV. A completion's ``policy_version`` is its chunk's prefill version (its first token's).

Streaming (``submit`` / ``poll`` / ``abort``, the ``StreamingBackend`` protocol): a slot-refill decode loop in
``sara.backends.hf_stream`` that draws every token as ``generate`` does (same completion for the same prompt and seed).

Log-probs: ``Completion.logprobs[i]`` is log p(token_i | prefix) under the model's own distribution (temperature 1, no
top-p truncation, computed in float32 from the generating weights), the same convention as vLLM's default
``raw_logprobs``. A policy recomputing log-probs of the same tokens agrees up to dtype/batching noise.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import Field

from sara.backends.hf_budget import KVBudget, chunk_rows, kv_budget, kv_bytes_per_position
from sara.backends.hf_cache import fill_from_end, with_spare
from sara.backends.hf_packed import pack_linears, release_packed
from sara.backends.hf_rows import Row
from sara.backends.sampling import sample_tokens
from sara.backends.text import encode_prompt, eos_ids, find_stop
from sara.backends.text import render_chat as _render_chat
from sara.config import SaraModel, validate_config
from sara.envs.base import Completion, GenerationRequest, SamplingConfig
from sara.hub import HoldsHFModel, generator_state, load_hf_model, resolve_hf_model
from sara.machine import DtypeChoice, resolve_dtype, weights_choice

__all__ = ["DTYPES", "HFBackend", "HFBackendConfig", "make_hf_backend", "load_hf_model"]

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
"""The torch dtype of each ``HFBackendConfig.dtype`` name a copy can be made in."""


class HFBackendConfig(SaraModel):
    """Options of the HF transformers backend."""

    model: str = "smollm2"
    """A model name prepared by ``sara model prepare`` (``smollm2``) or a local HF model directory."""
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"
    """Weight dtype of the generating copy. ``auto``: bfloat16 where ``device`` multiplies it natively, else float32
    (``sara.machine.resolve_dtype``: emulated bfloat16 is slower than float32; forcing it there warns once)."""
    device: str = "cpu"
    """Torch device of the generating model."""
    max_batch_size: int = Field(64, ge=1, le=4096)
    """Rows (completions) decoded together, at most 4096: larger rounds are split into chunks of whole requests, and
    the streaming loop (``submit`` / ``poll``, ``sara.backends.hf_stream``) decodes at most this many (the engine's
    capacity, ``slots``)."""
    kv_cache_gib: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    """GiB one batch's KV cache may take (rows x padded positions, ``sara.backends.hf_budget``): rounds are cut into
    chunks that fit and the streaming loop admits only rows that fit; ``auto``: 1/8 of the memory the process may use
    (the machine's, or the CUDA device's)."""
    share_policy: bool = False
    """Generate with the trainer's policy module itself (no copy, weight sync is free, but generation runs in the
    policy's dtype); otherwise the backend holds its own copy in ``dtype`` and ``update_weights`` copies the state."""
    prefix_cache_tokens: int = Field(8192, ge=0)
    """Prompt tokens whose prefill KV is kept across rounds and streaming admissions (``sara.backends.hf_prefix``:
    an open prompt probed again is not prefilled again); 0 disables the cache. Cleared by ``update_weights``."""
    shared_prefix_tokens: int = Field(16, ge=0)
    """Prompts prefilled together that start with at least this many common tokens (a task's few-shot examples or
    system prompt, the chat template's header) prefill that prefix once (``sara.backends.hf_shared``, kept across calls
    under one weights version; vLLM's prefix caching does the same); 0 = off."""
    packed_linear: bool = True
    """On a CPU in bfloat16, the generating copy's linear layers multiply with weights packed for oneDNN once per
    weights version instead of on every call (``sara.backends.hf_packed``: same numbers, fewer copies); only for a
    copy the backend owns (loaded by name, or copied from the policy), never a module it was handed."""
    cache_dir: str | None = None
    """Cache root for named models (default ``$SARA_CACHE_DIR`` or ``~/.cache/sara``)."""

    def dtype_choice(self) -> DtypeChoice:
        """The generating copy's dtype on ``device`` and why (``auto`` resolved by ``sara.machine``)."""
        return resolve_dtype(self.dtype, self.device)

    def kv_budget(self, shape: Mapping[str, Any] | None = None, dtype: str | None = None) -> KVBudget:
        """``kv_cache_gib`` resolved on this machine for the model of ``shape`` (its ``config.json``; default: read
        from ``model``'s directory without loading it, no bound when it is not there yet) cached in ``dtype``
        (default: ``dtype_choice``)."""
        from sara.hub import model_shape
        from sara.memory import device_memory_bytes

        shape = model_shape(self.model, self.cache_dir) if shape is None else shape
        element = DTYPES.get(dtype or self.dtype_choice().name, torch.float32).itemsize
        return kv_budget(self.kv_cache_gib, None if shape is None else kv_bytes_per_position(shape, element),
                         device_memory_bytes(self.device))


class HFBackend:
    """``GenerationBackend`` and ``StreamingBackend`` on a transformers causal LM.

    ``generate`` runs one round; ``submit`` / ``poll`` / ``abort`` / ``inflight`` stream single completions through a
    slot-refill decode loop (``sara.backends.hf_stream``) with ``slots`` rows, drawing every token as ``generate`` does.

    Args:
        model: A prepared model name / local HF directory (loaded here), or an already-loaded causal-LM module (used
            as is, not copied: pass ``tokenizer`` too).
        tokenizer: The tokenizer (required with a module; loaded from the directory otherwise).
        **options: ``HFBackendConfig`` fields (``dtype``, ``device``, ``max_batch_size``, ...).
    """

    def __init__(self, model: Any = None, tokenizer: Any = None, **options: Any) -> None:
        self.config, self.model, self.tokenizer = resolve_hf_model(model, tokenizer, options, HFBackendConfig,
                                                                   what="backend 'hf'")
        if not isinstance(model, torch.nn.Module) and self.config.packed_linear:  # loaded here: its own copy
            pack_linears(self.model, self.config.max_batch_size)
        model, tokenizer = self.model, self.tokenizer
        self.compute = weights_choice(model, None, "the policy's own module (share_policy)") if self.config.share_policy \
            else weights_choice(model, self.config.dtype_choice(), "the given module's weights")
        self.kv = self.config.kv_budget(model.config.to_dict(), self.compute.name)  # bounds both decode loops
        self.eos = eos_ids(tokenizer, getattr(model, "generation_config", None))
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos, default=0)
        self.pad_id = int(pad)
        self.version = 0
        self.closed = False
        self.tokens_generated = 0
        self.per_request_seeds = True  # every completion is a function of its own seed (see the module docstring)
        self.between_steps: Any = None  # SteppedEngine: called at every decode-step boundary (a weight sync cuts in)
        self._stream: Any = None  # the HFStreamEngine, created on the first submit
        self.prefix_cache: Any = None  # sara.backends.hf_prefix.PromptKVCache, or None when disabled
        if self.config.prefix_cache_tokens > 0:
            from sara.backends.hf_prefix import PromptKVCache

            self.prefix_cache = PromptKVCache(self.config.prefix_cache_tokens)
        self.shared_prefix: Any = None  # sara.backends.hf_shared.SharedPrefixes, or None when disabled
        if self.config.shared_prefix_tokens > 0:
            from sara.backends.hf_shared import SharedPrefixes

            self.shared_prefix = SharedPrefixes(self.config.shared_prefix_tokens)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Chat messages -> prompt text (chat template + generation prompt); for ``TaskEnv(render_chat=...)``."""
        return _render_chat(self.tokenizer, messages)

    # ------------------------------------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[list[Completion]]:
        """Return ``out[i]`` with ``requests[i].n`` completions, in seed order."""
        if self.closed:
            raise RuntimeError("HFBackend is closed")
        prompts = [encode_prompt(self.tokenizer, r.prompt) for r in requests]
        rows = [Row(i, prompts[i], int(s), int(r.max_new_tokens if r.max_new_tokens is not None
                                                else sampling.max_new_tokens))
                for i, r in enumerate(requests) for s in r.seeds]
        was_training = self.model.training
        self.model.eval()
        started: dict[int, int] = {}  # id(row) -> weights version of its chunk's prefill (its first token's logits)
        try:
            for chunk in chunk_rows(rows, self.config.max_batch_size, self.kv):
                self._between_steps()
                started.update((id(r), self.version) for r in chunk)
                self._generate_chunk(chunk, sampling)
        finally:
            if was_training:
                self.model.train()
        out: list[list[Completion]] = [[] for _ in requests]
        for row in rows:
            text = row.text if row.text is not None else self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            out[row.request].append(Completion(
                text=text, token_ids=tuple(row.tokens), logprobs=tuple(row.logprobs),
                prompt_token_ids=tuple(row.prompt_ids), finish_reason=row.finish, seed=row.seed,
                policy_version=started[id(row)]))
            self.tokens_generated += len(row.tokens)
        return out

    @torch.inference_mode()
    def _generate_chunk(self, rows: list[Row], sampling: SamplingConfig) -> None:
        dev = self.device
        # 1) prefill each distinct prompt once (left padding), then repeat its cache for its rows
        uniq: dict[int, int] = {}
        for r in rows:
            uniq.setdefault(r.request, len(uniq))
        prompt_of = {r.request: r.prompt_ids for r in rows}
        logits, cache, mask = self._prefill(plist := [prompt_of[q] for q in uniq])
        cache = with_spare(cache, max(r.cap for r in rows))  # decode writes in place, never a torch.cat per token
        sel = torch.tensor([uniq[r.request] for r in rows], dtype=torch.long, device=dev)
        logits = logits.index_select(0, sel)
        if len(plist) != len(rows) or not torch.equal(sel, torch.arange(len(rows), device=dev)):
            cache.reorder_cache(sel)
        mask = mask.index_select(0, sel)
        next_pos = mask.sum(-1, keepdim=True)  # position of the next token per row
        seeds = np.asarray([r.seed for r in rows], dtype=np.uint64)
        live = list(range(len(rows)))  # indices into rows of the batch rows, in batch order
        # 2) decode
        for t in range(max(r.cap for r in rows)):
            tok, lp = self._sample(logits, seeds[live], t, sampling)
            keep: list[int] = []
            for b, ri in enumerate(live):
                row = rows[ri]
                token = int(tok[b])
                row.tokens.append(token)
                row.logprobs.append(float(lp[b]))
                if token in self.eos:
                    row.finish = "stop"
                elif sampling.stop and self._hit_stop(row, sampling.stop):
                    row.finish = "stop"
                elif len(row.tokens) >= row.cap:
                    row.finish = "length"
                else:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(live):
                keep = fill_from_end(keep, len(live))  # only the rows that move are copied in the cache
                kt = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.reorder_cache(kt)
                mask, next_pos, tok = mask.index_select(0, kt), next_pos.index_select(0, kt), tok.index_select(0, kt)
            live = [live[b] for b in keep]
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=dev)], dim=1)
            self._between_steps()
            logits, cache = self._forward(tok.view(-1, 1), mask, next_pos, cache)
            next_pos = next_pos + 1
        for r in rows:  # a cap of 0 generates nothing
            r.finish = r.finish or "length"

    def _between_steps(self) -> None:
        """A decode-step boundary: run the ``between_steps`` hook when one is set (``sara.envs.base.SteppedEngine``)."""
        if self.between_steps is not None:
            self.between_steps()

    def _prefill(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Last-position logits ``[P, V]``, a fresh cache and the mask ``[P, W]`` of left-padded ``prompts`` (shared
        by the round loop and the streaming loop's admission), through the prompt-KV cache when it is on."""
        if self.prefix_cache is not None:
            return self.prefix_cache.prefill(self, prompts)
        return self._prefill_batch(prompts)

    def _prefill_batch(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """``_prefill`` without the prompt-KV cache: through a shared prefix when the prompts have one
        (``shared_prefix_tokens``), else ``_prefill_plain``."""
        if self.shared_prefix is not None:
            out = self.shared_prefix.prefill(self, prompts)
            if out is not None:
                return out
        return self._prefill_plain(prompts)

    def _prefill_plain(self, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """One forward over left-padded ``prompts``."""
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits, cache = self._forward(ids, mask, pos, DynamicCache())
        return logits, cache, mask

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
                 ) -> tuple[torch.Tensor, Any]:
        """Last-position logits ``[B, V]`` (float32) and the updated cache."""
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1, :].float(), out.past_key_values

    def _hit_stop(self, row: Row, stops: Sequence[str]) -> bool:
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        end = find_stop(text, stops)
        if end < 0:
            return False
        row.text = text[:end]
        return True

    @staticmethod
    def _sample(logits: torch.Tensor, seeds: np.ndarray, t: int | np.ndarray, sampling: SamplingConfig
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw one token per row (``sara.backends.sampling.sample_tokens``: inverse CDF with the per-row uniform
        ``u(seed, t)``); return ``(tokens, logp)``, ``logp`` under the raw distribution."""
        return sample_tokens(logits, seeds, t, sampling)

    # ------------------------------------------------------------------------------------------------ streaming
    @property
    def slots(self) -> int:
        """Completions the streaming loop decodes together at full occupancy."""
        return int(self.config.max_batch_size)

    def submit(self, items: Sequence[tuple[int, GenerationRequest]], sampling: SamplingConfig) -> None:
        """Queue one completion per ``(tag, request)`` (``request.n == 1``, tags unique while in flight)."""
        if self.closed:
            raise RuntimeError("HFBackend is closed")
        if self._stream is None:
            from sara.backends.hf_stream import HFStreamEngine

            self._stream = HFStreamEngine(self, self.slots, self.kv)
        self._stream.submit(items, sampling)

    def poll(self, timeout: float | None = None) -> list[tuple[int, Completion]]:
        """Run decode steps until a completion finished; return every finished ``(tag, completion)`` (``timeout`` is
        ignored: the loop is in process and deterministic). Empty only when nothing is in flight."""
        if self.closed:
            raise RuntimeError("HFBackend is closed")
        return self._stream.poll() if self._stream is not None else []

    def abort(self, tags: Sequence[int]) -> int:
        """Cancel in-flight completions (unknown / finished tags ignored); returns the tokens they had generated."""
        return self._stream.abort(tags) if self._stream is not None else 0

    def inflight(self) -> int:
        """Completions submitted and neither returned by ``poll`` nor aborted."""
        return self._stream.inflight() if self._stream is not None else 0

    # ------------------------------------------------------------------------------------------------ weights
    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load the trainer's weights (cast to this copy's dtype); a no-op copy when the module is shared."""
        if version <= self.version:
            raise ValueError(f"weights version must increase: got {version} after {self.version}")
        state = generator_state(state_dict)
        own = self.model.state_dict()
        if not all(k in own and own[k].data_ptr() == v.data_ptr() for k, v in state.items()
                   if isinstance(v, torch.Tensor)):
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            if unexpected or set(missing) - tied:
                raise ValueError(f"HFBackend.update_weights: state does not match the model (missing "
                                 f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
        self.version = int(version)
        self.reset_prefix_cache()

    def embed_prompts(self, prompts: Sequence[str | Sequence[Mapping[str, str]]]) -> np.ndarray:
        """``[prompts, D]``: the mean final hidden state over each prompt's tokens after the prompts' common prefix
        (forwarded once; ``sara.envs.base.EmbedsPrompts``; no sampling)."""
        from sara.backends.embed import embed_hf

        if self.closed:
            raise RuntimeError("HFBackend is closed")
        return embed_hf(self.model, self.tokenizer, prompts, pad_id=self.pad_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefill (as vLLM's ``reset_prefix_cache``); ``update_weights`` calls it."""
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        if self.shared_prefix is not None:
            self.shared_prefix.reset()

    def kv_line(self) -> str:
        """``BoundsKV``: the KV-cache budget both decode loops keep, in words (a run's first lines)."""
        return self.kv.line()

    def release_stale(self) -> None:
        """``ReleasesStale``: forget the cached prompt prefills and the packed weight copies (``hf_packed``, packed
        again by the next forward), both stale once the trainer's update changes the weights."""
        self.reset_prefix_cache()
        release_packed(self.model)

    def close(self) -> None:
        """Drop the model reference (memory is freed once the trainer lets go of it too)."""
        self.closed = True
        self.model = None
        self._stream = None
        self.prefix_cache = self.shared_prefix = None


def make_hf_backend(policy: Any = None, options: Mapping[str, Any] | None = None, **_: Any) -> HFBackend:
    """Backend factory for ``BACKENDS["hf"]``.

    With a policy that holds a causal LM (``HoldsHFModel``: an ``HFPolicy``) the backend generates from the policy's
    weights: the policy's own module when ``share_policy=true``, else a copy in the backend's ``dtype`` (the default);
    with any other policy, or none, it loads ``options["model"]``.
    """
    opts = dict(options or {})
    cfg = validate_config(HFBackendConfig, opts, what="backend 'hf'")
    if not isinstance(policy, HoldsHFModel):
        return HFBackend(**opts)
    module = policy.model
    if cfg.share_policy:
        return HFBackend(module, policy.tokenizer, **opts)
    gen = copy.deepcopy(module).to(dtype=DTYPES[cfg.dtype_choice().name], device=cfg.device).eval()
    gen.requires_grad_(False)
    if cfg.packed_linear:  # the copy is the backend's own
        pack_linears(gen, cfg.max_batch_size)
    return HFBackend(gen, policy.tokenizer, **opts)
