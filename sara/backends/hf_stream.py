"""Continuous batching for the HF backend: a slot-refill decode loop (``HFBackend.submit`` / ``poll`` / ``abort``).

The engine keeps up to ``slots`` completions in ONE running decode batch. Each ``poll`` runs decode steps until at
least one completion finishes; at the start of every step, queued completions are admitted into the free slots:

1. the newcomers are prefilled together (left padding; a prompt shared by several newcomers is prefilled once and its
   KV repeated; a prompt in the backend's prompt-KV cache, ``sara.backends.hf_prefix``, is not prefilled at all), in
   their own ``DynamicCache``;
2. their KV, attention mask and last logits JOIN the running batch: both caches are left-padded (zero keys / values,
   mask 0) to the wider one's length and written into one buffer per layer with room for the tokens still to come
   (``sara.backends.hf_cache.join_rows``), so the decode steps after a join write in place instead of copying the
   cache. Position ids are per row (a row's next position = its own token count), so padding columns never shift a
   row's positions;
3. one token is sampled for every row (token ``t`` of the completion with seed ``s`` is drawn exactly as
   ``HFBackend._sample`` draws it, with ``u(s, t)``), finished rows (EOS, stop string, cap) leave the batch and the
   cache (the last rows move into the freed slots: only they are copied, ``fill_from_end``), leading columns that
   are padding for every remaining row are trimmed once there are enough of them to be worth a copy
   (``TRIM_MIN``), and the rest take one forward step.

A completion is therefore the same function of (prompt, seed, weights) as ``generate``'s, whatever joins or leaves
the batch around it (up to last-bit logit noise with the batch shape, as for ``generate``: exact in float32 on the
tests' model, see ``tests/test_backend_hf_stream.py``). No wall-clock enters: the same sequence of calls gives the same
results.

Weights: ``update_weights`` between polls, or from the backend's ``between_steps`` hook before any step of a poll,
takes effect at the next forward. A completion then in flight keeps the KV
its earlier tokens computed; its ``policy_version`` is the version whose forward produced the logits of its first
token. Drivers that need single-version completions abort or drain in-flight work before updating.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sara.backends.hf_budget import KVBudget
from sara.backends.hf_cache import fill_from_end, join_rows, trim_front, with_spare
from sara.backends.hf_prefix import left_pad
from sara.backends.hf_rows import DecodeHost, Row
from sara.backends.text import encode_prompt
from sara.envs.base import Completion, GenerationRequest, SamplingConfig

__all__ = ["HFStreamEngine"]

TRIM_MIN = 16
"""Fewest all-padding leading columns worth trimming (a trim copies every row's cache; so does an eighth of the
width at least)."""


@dataclass
class _Slot(Row):
    """A streamed completion: a ``Row`` under a tag (``request``) with its sampling settings."""

    sampling: SamplingConfig = SamplingConfig()
    pending_version: int = -1  # weights version of the forward that computed this row's next-token logits
    first_version: int = -1  # ... of its first token's logits
    last_version: int = -1  # ... of its last token's logits


class HFStreamEngine:
    """The slot-refill loop over an ``HFBackend``'s model (created by the backend on its first ``submit``).

    Args:
        backend: The owning backend (model, tokenizer, EOS / pad ids, weights version, ``_sample``).
        slots: Completions decoded together at full occupancy.
        kv: The KV-cache budget (``sara.backends.hf_budget``): a queued row is admitted only while the running batch,
            the newcomers and the room they decode into fit; default no bound.

    Attributes:
        decode_steps: Decode forwards run so far (one per step with a non-empty batch).
        prefills: Prefill forwards run so far (one per step that admitted newcomers).
    """

    def __init__(self, backend: DecodeHost, slots: int, kv: KVBudget | None = None) -> None:
        self.backend = backend
        self.slots = int(slots)
        self.kv = kv or KVBudget(None, "no bound")
        self.queue: deque[_Slot] = deque()  # submitted, not yet admitted (FIFO)
        self.rows: list[_Slot] = []  # the running batch, in batch order
        self.done: list[_Slot] = []  # finished since the last poll (cap-0 requests land here at submit)
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, W] attention mask over the cache (+ pending token)
        self.next_pos: torch.Tensor | None = None  # [B, 1] position of each row's next token
        self.logits: torch.Tensor | None = None  # [B, V] float32, the next token's logits per row
        self.decode_steps = 0
        self.prefills = 0

    # ------------------------------------------------------------------------------------------------ public API
    def submit(self, items: Sequence[tuple[int, GenerationRequest]], sampling: SamplingConfig) -> None:
        """Queue one completion per ``(tag, request)``; requests must have exactly one seed, tags must be new."""
        live = {s.request for s in self.queue} | {s.request for s in self.rows} | {s.request for s in self.done}
        new: list[_Slot] = []
        for tag, req in items:
            if req.n != 1:
                raise ValueError(f"HFBackend.submit: tag {tag}: a streamed request has exactly one seed, got {req.n}")
            tag = int(tag)
            if tag in live:
                raise ValueError(f"HFBackend.submit: tag {tag} is already in flight")
            live.add(tag)
            cap = int(req.max_new_tokens if req.max_new_tokens is not None else sampling.max_new_tokens)
            ids = encode_prompt(self.backend.tokenizer, req.prompt)
            v = self.backend.version
            slot = _Slot(tag, ids, int(req.seeds[0]), cap, sampling=sampling, first_version=v, last_version=v)
            if cap <= 0:
                slot.finish = "length"
                self.done.append(slot)
            else:
                new.append(slot)
        self.queue.extend(new)

    def poll(self) -> list[tuple[int, Completion]]:
        """Run decode steps until at least one completion finished; return all finished ``(tag, completion)``."""
        model = self.backend.model
        was_training = model.training
        model.eval()
        try:
            while not self.done and (self.queue or self.rows):
                self.backend._between_steps()  # SteppedEngine: a weight sync may cut in before the step
                self._step()
        finally:
            if was_training:
                model.train()
        done, self.done = self.done, []
        return [(s.request, self._completion(s)) for s in done]

    def abort(self, tags: Sequence[int]) -> int:
        """Drop queued / running completions with these tags; return the tokens they had generated."""
        drop = {int(t) for t in tags}
        wasted = 0
        self.queue = deque(s for s in self.queue if s.request not in drop)
        keep = [b for b, s in enumerate(self.rows) if s.request not in drop]
        if len(keep) < len(self.rows):
            wasted = sum(len(s.tokens) for s in self.rows if s.request in drop)
            self._select(keep)
        self.done = [s for s in self.done if s.request not in drop]
        return wasted

    def inflight(self) -> int:
        """Completions submitted and neither returned by ``poll`` nor aborted."""
        return len(self.queue) + len(self.rows) + len(self.done)

    # ------------------------------------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def _step(self) -> None:
        """Admit newcomers, sample one token per row, retire finished rows, forward the rest one step."""
        if len(self.rows) < self.slots and self.queue and (new := self._admissible()):
            self._admit(new)
        b = self.backend
        assert self.logits is not None and self.mask is not None and self.next_pos is not None
        tok = torch.empty(len(self.rows), dtype=torch.long, device=self.logits.device)
        lp = torch.empty(len(self.rows), dtype=self.logits.dtype, device=self.logits.device)
        groups: dict[SamplingConfig, list[int]] = {}
        for i, s in enumerate(self.rows):
            groups.setdefault(s.sampling, []).append(i)
        for sampling, idx in groups.items():
            sel = torch.tensor(idx, dtype=torch.long, device=self.logits.device)
            seeds = np.asarray([self.rows[i].seed for i in idx], dtype=np.uint64)
            steps = np.asarray([len(self.rows[i].tokens) for i in idx], dtype=np.int64)
            t, p = b._sample(self.logits.index_select(0, sel), seeds, steps, sampling)
            tok[sel], lp[sel] = t, p
        keep: list[int] = []
        for i, s in enumerate(self.rows):
            token = int(tok[i])
            if not s.tokens:
                s.first_version = s.pending_version
            s.last_version = s.pending_version
            s.tokens.append(token)
            s.logprobs.append(float(lp[i]))
            if token in b.eos:
                s.finish = "stop"
            elif s.sampling.stop and b._hit_stop(s, s.sampling.stop):
                s.finish = "stop"
            elif len(s.tokens) >= s.cap:
                s.finish = "length"
            else:
                keep.append(i)
                continue
            self.done.append(s)
        order = self._select(keep)
        tok = tok.index_select(0, torch.tensor(order, dtype=torch.long, device=tok.device))
        if not self.rows:
            return
        mask = self.mask
        self.mask = torch.cat([mask, torch.ones((len(self.rows), 1), dtype=mask.dtype, device=mask.device)], dim=1)
        self.logits, self.cache = b._forward(tok.view(-1, 1), self.mask, self.next_pos, self.cache)
        self.next_pos = self.next_pos + 1
        self.decode_steps += 1
        for s in self.rows:
            s.pending_version = b.version

    def _admissible(self) -> list[_Slot]:
        """Pop the queued rows that join at this step: into the free slots, in order, while the batch's cache (every
        row at the widest prompt, with room for the most tokens any row may still generate, as ``join_rows`` lays it
        out) fits the KV budget; at least one row when none is running."""
        wide = self.mask.shape[1] if self.mask is not None else 0
        spare = max((s.cap - len(s.tokens) for s in self.rows), default=0) + 1
        new: list[_Slot] = []
        while self.queue and len(self.rows) + len(new) < self.slots:
            head = self.queue[0]
            w, sp = max(wide, len(head.prompt_ids)), max(spare, head.cap + 1)
            if (self.rows or new) and not self.kv.fits(len(self.rows) + len(new) + 1, w + 2 * sp):
                break
            new.append(self.queue.popleft())
            wide, spare = w, sp
        return new

    def _admit(self, new: list[_Slot]) -> None:
        """Prefill the newcomers (each distinct prompt once) and join them to the running batch."""
        b = self.backend
        dev = b.device
        uniq: dict[tuple[int, ...], int] = {}
        for s in new:
            uniq.setdefault(tuple(s.prompt_ids), len(uniq))
        logits, cache, mask = b._prefill(list(uniq))
        self.prefills += 1
        sel = torch.tensor([uniq[tuple(s.prompt_ids)] for s in new], dtype=torch.long, device=dev)
        if len(uniq) != len(new) or not torch.equal(sel, torch.arange(len(new), device=dev)):
            cache.reorder_cache(sel)
            logits, mask = logits.index_select(0, sel), mask.index_select(0, sel)
        next_pos = mask.sum(-1, keepdim=True)
        for s in new:
            s.pending_version = b.version
        spare = max(s.cap - len(s.tokens) for s in [*self.rows, *new]) + 1  # decode steps write in place
        if not self.rows:
            self.rows, self.mask, self.next_pos, self.logits = new, mask, next_pos, logits
            self.cache = with_spare(cache, spare)
            return
        assert self.mask is not None and self.next_pos is not None and self.logits is not None
        wide = max(self.mask.shape[1], mask.shape[1])
        room = min(self.slots, self.kv.max_rows(wide + 2 * spare) or self.slots)  # rows a fresh buffer makes room for
        join_rows(self.cache, cache, wide, spare, rows=room)  # in place where the buffers have room
        self.mask = torch.cat([left_pad(self.mask, wide, -1), left_pad(mask, wide, -1)], dim=0)
        self.next_pos = torch.cat([self.next_pos, next_pos], dim=0)
        self.logits = torch.cat([self.logits, logits], dim=0)
        self.rows = self.rows + new

    @torch.inference_mode()  # abort calls it too: the cache's buffers are written in place
    def _select(self, keep: list[int]) -> list[int]:
        """Keep only the batch rows ``keep`` (ascending: cache, mask, positions, logits), the rows that stay in place
        where they can (``fill_from_end``: only moved rows are copied), and trim leading columns no row attends to
        once they are worth a copy; returns the new batch order (indices into the old batch)."""
        if len(keep) == len(self.rows):
            return keep
        order = fill_from_end(keep, len(self.rows))
        self.rows = [self.rows[i] for i in order]
        if not self.rows:
            self.cache = self.mask = self.next_pos = self.logits = None
            return order
        assert self.mask is not None and self.next_pos is not None and self.logits is not None
        kt = torch.tensor(order, dtype=torch.long, device=self.mask.device)
        self.cache.reorder_cache(kt)
        self.mask, self.next_pos = self.mask.index_select(0, kt), self.next_pos.index_select(0, kt)
        self.logits = self.logits.index_select(0, kt)
        lead = int(self.mask.any(dim=0).long().argmax())  # first column some row attends to
        if lead >= max(TRIM_MIN, self.mask.shape[1] // 8):  # a trim copies every row: only when it frees enough
            self.mask = self.mask[:, lead:]
            trim_front(self.cache, lead, max(s.cap - len(s.tokens) for s in self.rows) + 1)
        return order

    def _completion(self, s: _Slot) -> Completion:
        b = self.backend
        text = s.text if s.text is not None else b.tokenizer.decode(s.tokens, skip_special_tokens=True)
        b.tokens_generated += len(s.tokens)
        return Completion(text=text, token_ids=tuple(s.tokens), logprobs=tuple(s.logprobs),
                          prompt_token_ids=tuple(s.prompt_ids), finish_reason=s.finish, seed=s.seed,
                          policy_version=s.first_version)
