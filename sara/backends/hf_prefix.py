"""The HF backend's prompt-KV cache: a prompt's prefill (per-layer keys / values, last-position logits) kept across
calls, the role vLLM's automatic prefix caching plays on vLLM.

SARA probes an open prompt over several rounds, or (streaming) one rollout at a time as slots free up: without a cache
every probe prefills its prompt again, and on short completions the prefill is most of the work (measured on
SmolLM2-135M, 3-shot 1-digit sums, ~25 prompt tokens and ~3 completion tokens: docs/backends.md). A round's rows of one
prompt already share one prefill (``HFBackend._generate_chunk``); the cache extends the sharing across rounds and
admissions.

Entries are keyed by the prompt's token ids and belong to one weights version: ``HFBackend.update_weights`` clears the
cache, and a lookup under another version starts from an empty cache, so a cached KV never outlives its weights (a
caller that edits the module's weights in place without ``update_weights`` must call ``reset()``). Least-recently used
entries are evicted beyond ``max_tokens`` cached prompt tokens. Each entry is stored unpadded and joined to a batch by
left zero-padding (attention mask 0), the same padding the streaming loop uses to join caches, so a hit gives the KV a
prefill of that prompt computed (up to the last-bit noise of a different batch shape, as for any batching).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PromptKVCache", "left_pad"]


@dataclass
class _Entry:
    keys: list[torch.Tensor]  # per layer [1, H, L, D]
    values: list[torch.Tensor]  # per layer [1, H, L, D]
    logits: torch.Tensor  # [V] float32, the next token's logits after the prompt

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[-2])


class PromptKVCache:
    """LRU cache of prompt prefills for one ``HFBackend``.

    Args:
        max_tokens: Most prompt tokens kept (summed over entries); older entries are evicted first.

    Attributes:
        hits: Prompts served from the cache so far.
        misses: Prompts prefilled so far (cache misses).
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"PromptKVCache: max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self.version: int | None = None
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Prompt tokens currently cached."""
        return self._tokens

    def reset(self) -> None:
        """Drop every entry (the hit / miss counters stay)."""
        self._entries.clear()
        self._tokens = 0

    def prefill(self, backend: Any, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """``backend._prefill_batch(prompts)``'s result, prefilling only the prompts not cached under the backend's
        current weights version: last-position logits ``[P, V]`` (float32), a fresh ``DynamicCache``, mask ``[P, W]``.
        """
        if backend.version != self.version:
            self.reset()
            self.version = backend.version
        keys = [tuple(int(t) for t in p) for p in prompts]
        found: dict[tuple[int, ...], _Entry] = {}
        for k in dict.fromkeys(keys):
            e = self._entries.get(k)
            if e is not None:
                self._entries.move_to_end(k)
                found[k] = e
        self.hits += len(found)
        miss = [k for k in dict.fromkeys(keys) if k not in found]
        if miss:
            self.misses += len(miss)
            logits, cache, mask = backend._prefill_batch(miss)
            width = mask.shape[1]
            for i, k in enumerate(miss):
                lo = width - len(k)
                entry = _Entry(keys=[layer.keys[i:i + 1, :, lo:, :].clone() for layer in cache.layers],
                               values=[layer.values[i:i + 1, :, lo:, :].clone() for layer in cache.layers],
                               logits=logits[i].clone())
                found[k] = entry
                self._store(k, entry)
            if miss == keys:  # nothing was cached: the fresh prefill is the answer as it is
                return logits, cache, mask
        return _assemble([found[k] for k in keys], device=backend.device)

    def _store(self, key: tuple[int, ...], entry: _Entry) -> None:
        if entry.length > self.max_tokens:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= old.length
        self._entries[key] = entry
        self._tokens += entry.length
        while self._tokens > self.max_tokens:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= dropped.length


def _assemble(entries: list[_Entry], *, device: Any) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Left-pad the entries to a common width and stack them into one batch: logits, ``DynamicCache``, mask."""
    from transformers import DynamicCache

    width = max(e.length for e in entries)
    mask = torch.zeros((len(entries), width), dtype=torch.long, device=device)
    for i, e in enumerate(entries):
        mask[i, width - e.length:] = 1
    cache = DynamicCache()
    for layer in range(len(entries[0].keys)):
        k = torch.cat([left_pad(e.keys[layer], width, -2) for e in entries], dim=0)
        v = torch.cat([left_pad(e.values[layer], width, -2) for e in entries], dim=0)
        cache.update(k, v, layer)
    logits = torch.stack([e.logits for e in entries], dim=0)
    return logits, cache, mask


def left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad ``x`` on the left of dimension ``dim`` (-1: a mask ``[B, W]``; -2: keys / values ``[B, H, W, D]``) to
    ``width`` (the streaming loop's joins and the cache's batches pad the same way)."""
    extra = width - x.shape[dim]
    if extra <= 0:
        return x
    return F.pad(x, (extra, 0) if dim == -1 else (0, 0, extra, 0))
