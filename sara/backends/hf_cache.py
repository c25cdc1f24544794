"""KV-cache layers with spare positions for the HF backend's decode loops.

``transformers.DynamicCache`` appends every decoded token with ``torch.cat``, which copies the layer's whole cache:
decoding ``n`` tokens after a ``P``-token prompt copies ``O(n x (P + n))`` positions per row and layer, and at
reasoning length (a long few-shot prompt, tens of new tokens, a batch of rows) those copies outweigh the step's
matmuls. ``SpareLayer`` keeps each layer's keys / values in buffers with room for the tokens still to come and writes
a step's positions in place; ``keys`` / ``values`` are views of the filled part, so attention reads exactly the tensor
values ``torch.cat`` would have produced. When the room runs out the buffers grow by a quarter (amortized O(1) copies
per token); a batch reorder (rows finishing) copies the filled part only and keeps the room, and when the decode
loop orders the rows it keeps with ``fill_from_end`` only the rows that move are copied.

``with_spare(cache, spare)`` converts a filled ``DynamicCache`` in place before a decode loop; layers of another kind
(sliding windows, linear attention) are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

__all__ = ["SpareLayer", "fill_from_end", "join_rows", "trim_front", "with_spare"]


class SpareLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` / ``values`` ``[B, H, L, D]`` are views of ``[B, H, L + room, D]`` buffers.

    Assigning ``keys`` / ``values`` (as the streaming loop does when it joins caches) adopts the tensor as the new
    buffer, without room; the next ``update`` grows it.
    """

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None, spare: int = 0) -> None:
        self._bk: torch.Tensor | None = None
        self._bv: torch.Tensor | None = None
        self._nk = self._nv = 0
        super().__init__()
        if keys is not None and values is not None:
            self._bk, self._nk = _with_room(keys, spare), int(keys.shape[-2])
            self._bv, self._nv = _with_room(values, spare), int(values.shape[-2])
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

    # keys / values: views of the filled part of the buffers
    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        return None if self._bk is None else self._bk[..., : self._nk, :]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._bk, self._nk = _adopt(value)

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        return None if self._bv is None else self._bv[..., : self._nv, :]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._bv, self._nv = _adopt(value)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions after the filled part (growing the buffers when full); return the filled views."""
        if not self.is_initialized or self._bk is None or self._bk.dim() != 4:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.is_initialized = True
            self._bk, self._nk = _with_room(key_states, 0), int(key_states.shape[-2])
            self._bv, self._nv = _with_room(value_states, 0), int(value_states.shape[-2])
        else:
            self._bk, self._nk = _append(self._bk, self._nk, key_states)
            assert self._bv is not None
            self._bv, self._nv = _append(self._bv, self._nv, value_states)
        out_k, out_v = self.keys, self.values
        assert out_k is not None and out_v is not None
        return out_k, out_v

    def get_seq_length(self) -> int:
        return self._nk if self._bk is not None and self._bk.dim() == 4 else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep rows ``beam_idx`` (in that order), their room kept: only the filled positions are copied."""
        if self.get_seq_length() > 0:
            assert self._bk is not None and self._bv is not None
            self._bk = _select_rows(self._bk, self._nk, beam_idx)
            self._bv = _select_rows(self._bv, self._nv, beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.reorder_cache(torch.as_tensor(indices, dtype=torch.long))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``|tokens_to_remove|`` positions (``DynamicLayer.crop``'s negative form) or keep the first
        ``tokens_to_remove`` (its legacy positive form); the buffers keep their room."""
        n = self.get_seq_length()
        keep = tokens_to_remove if tokens_to_remove > 0 else n - abs(tokens_to_remove)
        self._nk = self._nv = max(0, min(n, keep))


def _adopt(value: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    if value is None or value.dim() != 4:
        return value, 0
    return value, int(value.shape[-2])


def _with_room(x: torch.Tensor, room: int) -> torch.Tensor:
    """A fresh ``[B, H, L + room, D]`` buffer whose first ``L`` positions hold ``x``."""
    b, h, n, d = x.shape
    buf = x.new_empty((b, h, n + max(0, int(room)), d))
    buf[..., :n, :] = x
    return buf


def _append(buf: torch.Tensor, filled: int, new: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Write ``new`` after ``filled`` positions of ``buf`` (a grown copy when it does not fit)."""
    need = filled + int(new.shape[-2])
    if need > buf.shape[-2]:
        grown = new.new_empty((new.shape[0], buf.shape[1], max(need, filled + filled // 4 + 16), buf.shape[-1]))
        grown[..., :filled, :] = buf[..., :filled, :]
        buf = grown
    buf[..., filled:need, :] = new
    return buf, need


def _select_rows(buf: torch.Tensor, filled: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``buf``: in place when most stay where they are (``fill_from_end``'s orders: copy the moved rows
    only, then a view of the leading rows), else a fresh buffer."""
    rows = rows.to(buf.device)
    moved = (rows != torch.arange(len(rows), device=buf.device)).nonzero().flatten()
    if len(rows) <= buf.shape[0] and 2 * len(moved) <= len(rows):
        if len(moved):
            buf[moved, :, :filled] = buf[rows[moved], :, :filled]  # index (a copy) before the write: no aliasing
        return buf[: len(rows)]
    out = buf.new_empty((len(rows), *buf.shape[1:]))
    out[..., :filled, :] = buf[..., :filled, :].index_select(0, rows)
    return out


def fill_from_end(keep: list[int], size: int) -> list[int]:
    """A batch order that keeps the rows ``keep`` (ascending positions in a batch of ``size``) and moves as few as
    it can: a kept row among the first ``len(keep)`` stays; the others fill the freed slots (their new positions are
    the list's indices), so ``SpareLayer.reorder_cache`` copies the moved rows only."""
    n = len(keep)
    stay = set(b for b in keep if b < n)
    movers = iter(b for b in keep if b >= n)
    return [b if b in stay else next(movers) for b in range(n)]


def with_spare(cache: Any, spare: int) -> Any:
    """Turn ``cache``'s plain dynamic layers into ``SpareLayer``s with ``spare`` free positions each (in place).

    Args:
        cache: A filled ``transformers.DynamicCache`` (or any cache with a ``layers`` list).
        spare: Positions to reserve (the most tokens the decode loop may still append).

    Returns:
        ``cache``.
    """
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return cache
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4:
            layers[i] = SpareLayer(layer.keys, layer.values, spare)
        elif isinstance(layer, SpareLayer) and layer._bk is not None and layer._bk.dim() == 4:
            room = layer._bk.shape[-2] - layer._nk
            if room < spare:
                layers[i] = SpareLayer(layer.keys, layer.values, spare)
    return cache


def join_rows(cache: Any, other: Any, width: int, spare: int, rows: int = 0) -> None:
    """Append ``other``'s rows to ``cache``'s (in place), both left-padded with zeros to ``width`` positions, into
    ``SpareLayer`` buffers with ``spare`` free positions after ``width``.

    When a running layer's buffer already has room for the newcomers (rows beyond its view, left there by
    ``reorder_cache``'s in-place path or by an earlier join, and ``spare`` free positions at ``width``), only the
    newcomers are written; otherwise both are copied into a fresh buffer with room for ``rows`` rows in all and for
    ``2 * spare`` positions, so the joins of the next ``spare`` steps can be written in place. Either way the decode
    steps after a join write in place (a join by ``torch.cat`` leaves no room: the next step would copy it all again).

    Args:
        cache: The running cache (``layers``: dynamic or spare layers, ``[B, H, L, D]``); its layers are replaced.
        other: The newcomers' cache (``[B2, H, L2, D]``), ``L``, ``L2`` <= ``width``.
        width: Positions of the joined cache.
        spare: Free positions to reserve after ``width``.
        rows: Rows to make room for in a fresh buffer (the engine's capacity; at least ``B + B2``).
    """
    for i, (old, new) in enumerate(zip(cache.layers, other.layers)):
        room_rows, room_positions = _room_of(old._bk) if isinstance(old, SpareLayer) and old._bk is not None else (0, 0)
        if (isinstance(old, SpareLayer) and old._bk is not None and old._bv is not None and old._nk == width
                and room_rows >= old._bk.shape[0] + new.keys.shape[0] and room_positions >= width + spare):
            old._bk = _write_rows(old._bk, new.keys, width)
            old._bv = _write_rows(old._bv, new.values, width)
            continue
        joined = SpareLayer()
        for name in ("keys", "values"):
            a, b = getattr(old, name), getattr(new, name)
            n = a.shape[0] + b.shape[0]
            buf = a.new_empty((max(n, int(rows)), a.shape[1], width + 2 * max(0, int(spare)), a.shape[-1]))
            buf[:n, :, : width - a.shape[-2]].zero_()
            buf[: a.shape[0], :, width - a.shape[-2] : width] = a
            buf[a.shape[0] : n, :, : width - b.shape[-2]].zero_()
            buf[a.shape[0] : n, :, width - b.shape[-2] : width] = b
            if name == "keys":
                joined._bk, joined._nk = buf[:n], width
            else:
                joined._bv, joined._nv = buf[:n], width
        joined.dtype, joined.device, joined.is_initialized = old.keys.dtype, old.keys.device, True
        cache.layers[i] = joined


def _room_of(buf: torch.Tensor) -> tuple[int, int]:
    """``(rows, positions)`` the storage behind the view ``buf`` (``[B, H, L, D]``, rows outermost) can hold."""
    _, h, _, d = buf.shape
    s0, s1, s2, s3 = buf.stride()
    if s3 != 1 or s2 != d or s1 % d or s0 != h * s1 or not buf.numel():  # not a row-major [B, H, L + room, D]
        return int(buf.shape[0]), int(buf.shape[-2])
    elems = buf.untyped_storage().nbytes() // buf.element_size() - buf.storage_offset()
    return int(elems // s0), int(s1 // d)


def _write_rows(buf: torch.Tensor, new: torch.Tensor, width: int) -> torch.Tensor:
    """``buf``'s view grown by ``new``'s rows, written in place after its rows, left-padded with zeros to ``width``."""
    b, n = int(buf.shape[0]), int(new.shape[0])
    grown = buf.as_strided((b + n, *buf.shape[1:]), buf.stride(), buf.storage_offset())
    grown[b:, :, : width - new.shape[-2]].zero_()
    grown[b:, :, width - new.shape[-2] : width] = new
    return grown


def trim_front(cache: Any, lead: int, spare: int) -> None:
    """Drop every layer's first ``lead`` positions (in place), keeping ``spare`` free positions after the rest."""
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys[..., lead:, :], layer.values[..., lead:, :]
        cache.layers[i] = SpareLayer(keys, values, spare)
