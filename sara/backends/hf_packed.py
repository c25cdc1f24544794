"""The generating copy's bfloat16 linear layers on a CPU, through oneDNN with their weights packed once per weights
version (``pack_linears``).

A decode step multiplies a few dozen rows by every weight matrix. ``torch.nn.functional.linear`` in bfloat16 on a CPU
hands oneDNN the weight in its plain layout on every call, and oneDNN reorders it into its blocked layout each time:
for the small row counts of decoding that reorder costs about as much as the product itself. ``PackedLinear`` keeps
the reordered weight (``torch.ops.mkldnn._reorder_linear_weight``) and multiplies with it
(``torch.ops.mkldnn._linear_pointwise``): the same oneDNN kernel, so the same numbers, without the per-call reorder.

The packed copy follows its weight: ``load_state_dict`` (a weight sync) writes the weight in place, which bumps the
tensor's version counter, and the next forward packs again. ``release_packed`` drops the copies (the HF backend's
``release_stale``, which the trainer calls when an update starts: they are stale from there and about as large as the
weights). Only for modules that do not train: a forward that needs a
gradient, or an input of another dtype or device, runs ``torch.nn.functional.linear`` unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

__all__ = ["PackedLinear", "can_pack", "pack_linears", "release_packed"]


@functools.cache
def _packs_bf16() -> bool:
    """Whether oneDNN packs and multiplies a bfloat16 weight here (it refuses on a CPU without AVX-512 BW / VL / DQ or
    AVX-NE-CONVERT, or under an ``ONEDNN_MAX_CPU_ISA`` below them)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(2, 2, dtype=torch.bfloat16), 1)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2, dtype=torch.bfloat16), w, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool((out == 2).all())


def can_pack(module: nn.Module) -> bool:
    """Whether ``module`` holds bfloat16 weights on the CPU and oneDNN packs bfloat16 weights on this one."""
    param = next(module.parameters(), None)
    return param is not None and param.device.type == "cpu" and param.dtype == torch.bfloat16 and _packs_bf16()


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` over the same parameters (state-dict keys, ties and all) whose inference forward uses a packed
    copy of its weight.

    Args:
        linear: The layer to take over; its ``weight`` and ``bias`` parameters are shared, not copied.
        batch_hint: The row count oneDNN's packed layout is chosen for (any row count gives the same product).
    """

    def __init__(self, linear: nn.Linear, batch_hint: int) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.batch_hint = int(batch_hint)
        self._packed: torch.Tensor | None = None
        self._packed_version = -1
        self.packs = 0  # how many times the weight was packed (once per weights version it is used under)

    def _pack(self) -> torch.Tensor:
        version = self.weight._version
        if self._packed is None or version != self._packed_version:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), self.batch_hint)
            self._packed_version = version
            self.packs += 1
        return self._packed

    def release(self) -> None:
        """Drop the packed copy (the next inference forward packs again)."""
        self._packed, self._packed_version = None, -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dtype != w.dtype or x.device != w.device or x.numel() == 0
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return nn.functional.linear(x, w, self.bias)
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self._pack(), self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module, batch_hint: int = 64) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a ``PackedLinear`` over the same parameters when ``can_pack``;
    returns how many were replaced (0: nothing changed)."""
    if not can_pack(model):
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child, batch_hint))
    return len(swaps)


def release_packed(model: nn.Module) -> int:
    """Drop the packed copies of ``model``'s ``PackedLinear`` layers (about the size of its weights: released before a
    trainer's update, they are not held under its memory peak); returns how many held one."""
    held = [m for m in model.modules() if isinstance(m, PackedLinear) and m._packed is not None]
    for m in held:
        m.release()
    return len(held)
