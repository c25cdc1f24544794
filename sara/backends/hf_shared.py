"""Shared-prefix prefill for the HF backend: the leading tokens that every prompt of one prefill starts with (a
task's few-shot examples or system prompt, the chat template's header) are prefilled once, not once per prompt.

On ``sara/Arithmetic-v0:...,shots=3`` rendered for SmolLM2 the prompts are 28-30 tokens long and share their first 24,
so a prefill of B prompts runs 24 + B x ~5 prompt positions instead of B x ~29 (vLLM's automatic prefix caching
shares them the same way). ``HFBackendConfig.shared_prefix_tokens`` sets the shortest prefix worth sharing (0 = off).

How: the prompts' longest common prefix (shorter than the shortest prompt, so every prompt keeps a suffix token for
its logits) is prefilled as one row, or taken from the few prefixes kept from earlier calls under the same weights
version (a streaming admission of a single prompt reuses the prefix of an earlier batch; a batch whose own common
prefix is at least ``min_tokens`` longer than the kept one it starts with gets that longer prefix prefilled and
kept). The suffixes are then prefilled together on top of the prefix's KV, broadcast to every row, with per-row
positions continuing after the prefix and the suffixes' left padding masked between prefix and suffix. Finally each
row's keys / values are moved so its real tokens end the row (the left-padded layout every other prefill returns):
callers cannot tell the difference, up to last-bit logit noise of a different computation order (exact in float32
on the tests' model). The common-prefix length and the broadcast cache are ``sara.policies.prefix``'s, shared with
the learner's training forward (``HFPolicy.score_at``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from sara.policies.prefix import broadcast_cache, common_prefix_len

__all__ = ["SharedPrefixes"]


class SharedPrefixes:
    """Prefix KVs of one ``HFBackend`` (the most recent ``max_entries``, under one weights version).

    Args:
        min_tokens: The shortest common prefix worth prefilling once.
        max_entries: Prefixes kept across calls.

    Attributes:
        hits: Prefills that reused a kept prefix.
        prefills: Prefixes prefilled.
    """

    def __init__(self, min_tokens: int, max_entries: int = 8) -> None:
        if min_tokens < 1:
            raise ValueError(f"SharedPrefixes: min_tokens must be >= 1, got {min_tokens}")
        self.min_tokens = int(min_tokens)
        self.max_entries = int(max_entries)
        self.version: int | None = None
        self.hits = self.prefills = 0
        self._kv: OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = OrderedDict()

    def reset(self) -> None:
        """Drop every kept prefix (the counters stay)."""
        self._kv.clear()

    def prefill(self, backend: Any, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, Any, torch.Tensor] | None:
        """``backend._prefill_plain(prompts)``'s result (logits ``[B, V]``, ``DynamicCache``, left-padded mask
        ``[B, W]``) computed through shared prefixes, or None when no two prompts share ``min_tokens`` leading tokens
        beyond what all of them share and the prompts share fewer than ``min_tokens`` (the caller then prefills them
        whole).

        A batch that mixes prompt families (a mixture task's components, each with its own few-shot examples) is
        split by family: prompts that agree on ``min_tokens`` tokens past the batch's common prefix are prefilled
        together through their own longer prefix, the rest through the batch's; the parts are merged back into one
        left-padded batch in the prompts' order."""
        if backend.version != self.version:
            self.reset()
            self.version = backend.version
        keys = [tuple(int(t) for t in p) for p in prompts]
        families: dict[tuple[int, ...], list[int]] = {}
        width = common_prefix_len(keys) + self.min_tokens
        for i, k in enumerate(keys):
            families.setdefault(k[:width] if len(k) > width else k, []).append(i)
        if len(families) == 1 or max(len(v) for v in families.values()) == 1:
            return self._prefill_family(backend, keys)
        rest = [i for v in families.values() if len(v) == 1 for i in v]
        parts = [v for v in families.values() if len(v) > 1] + ([rest] if rest else [])
        outs = []
        for idx in parts:
            sub = [keys[i] for i in idx]
            outs.append(self._prefill_family(backend, sub) or backend._prefill_plain([list(k) for k in sub]))
        return _merge(outs, [i for idx in parts for i in idx])

    def _prefill_family(self, backend: Any, keys: list[tuple[int, ...]]
                        ) -> tuple[torch.Tensor, Any, torch.Tensor] | None:
        """``prefill`` of prompts treated as one family (one common prefix, kept or prefilled)."""
        shortest = min(len(k) for k in keys)
        kept = max((p for p in self._kv if len(p) < shortest and all(k[:len(p)] == p for k in keys)),
                   key=len, default=None)
        size = min(common_prefix_len(keys), shortest - 1) if len(keys) > 1 else 0
        if kept is not None and size < len(kept) + self.min_tokens:  # this batch shares little more than it
            prefix = kept
            self._kv.move_to_end(prefix)
            self.hits += 1
        elif size < self.min_tokens:
            return None
        else:  # a new shared prefix, or one at least min_tokens longer than the kept one: prefill it once, keep it
            prefix = keys[0][:size]
            _, cache, _ = backend._prefill_plain([list(prefix)])
            self._kv[prefix] = ([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])
            self.prefills += 1
            while len(self._kv) > self.max_entries:
                self._kv.popitem(last=False)
        return _prefill_suffixes(backend, self._kv[prefix], keys, len(prefix))


def _merge(outs: list[tuple[torch.Tensor, Any, torch.Tensor]], order: list[int]
           ) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """One left-padded batch from prefills of disjoint parts of it: each part's mask and keys / values padded on the
    left to the widest part, concatenated, rows put back in the prompts' order (``order[j]``: the prompt of
    concatenated row ``j``)."""
    from transformers import DynamicCache

    width = max(mask.shape[1] for _, _, mask in outs)
    dev = outs[0][2].device
    back = torch.empty(len(order), dtype=torch.long, device=dev)
    back[torch.tensor(order, dtype=torch.long, device=dev)] = torch.arange(len(order), device=dev)
    logits = torch.cat([lg for lg, _, _ in outs]).index_select(0, back)
    mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for _, _, m in outs]).index_select(0, back)
    cache = DynamicCache()
    for li in range(len(outs[0][1].layers)):
        ks, vs = [], []
        for _, c, m in outs:
            pad = (0, 0, width - m.shape[1], 0)  # [B, H, W, D]: pad W on the left
            ks.append(torch.nn.functional.pad(c.layers[li].keys, pad))
            vs.append(torch.nn.functional.pad(c.layers[li].values, pad))
        cache.update(torch.cat(ks).index_select(0, back), torch.cat(vs).index_select(0, back), li)
    return logits, cache, mask


def _prefill_suffixes(backend: Any, kv: tuple[list[torch.Tensor], list[torch.Tensor]], keys: list[tuple[int, ...]],
                      p: int) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """Prefill the suffixes ``key[p:]`` on top of the prefix KV ``kv``; return the left-padded layout."""
    dev = backend.device
    b = len(keys)
    lens = torch.tensor([len(k) - p for k in keys], dtype=torch.long, device=dev)  # every suffix >= 1 token
    s = int(lens.max())
    ids = torch.full((b, s), backend.pad_id, dtype=torch.long)
    smask = torch.zeros((b, s), dtype=torch.long)
    for i, k in enumerate(keys):
        ids[i, s - len(k) + p:] = torch.tensor(k[p:], dtype=torch.long)
        smask[i, s - len(k) + p:] = 1
    ids, smask = ids.to(dev), smask.to(dev)
    mask = torch.cat([torch.ones((b, p), dtype=torch.long, device=dev), smask], dim=1)  # [B, P + S]
    pos = p + (smask.cumsum(-1) - 1).clamp(min=0)  # positions continue after the prefix
    cache = broadcast_cache(list(zip(*kv)), b)  # the prefix's KV for every row (sara.policies.prefix)
    logits, cache = backend._forward(ids, mask, pos, cache)
    # Row i's real columns are 0..p-1 (prefix) and p+s-len_i .. p+s-1 (suffix); move them to the row's end.
    width = p + s
    col = torch.arange(width, device=dev)
    rel = col[None, :] - (width - p - lens)[:, None]  # [B, W] index among the row's real tokens (< 0: padding)
    src = torch.where(rel < p, rel, p + s - lens[:, None] + (rel - p)).clamp(min=0)
    for layer in cache.layers:
        idx = src[:, None, :, None].expand(b, layer.keys.shape[1], width, layer.keys.shape[-1])
        layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
    return logits, cache, (rel >= 0).long()
