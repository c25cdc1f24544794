"""A small explicit encoding of training state: JSON for the structure, tensors for the numbers. No pickle.

``encode(obj)`` returns ``(tree, tensors)``: ``tree`` is JSON-able, ``tensors`` maps names to CPU tensors (a file of
them loads with ``torch.load(weights_only=True)``, which executes no code). ``decode(tree, tensors)`` inverts it.

What it stores, and how (anything else is refused with a ``TypeError`` naming where it sits in the state):

- ``None``, ``bool``, ``int``, ``str``, finite ``float``: JSON as is; ``nan`` / ``inf``: ``{"$float": "nan"}``.
- ``list``: a JSON list; ``tuple``: ``{"$tuple": [...]}`` (python's RNG state and AdamW's betas stay tuples).
- ``dict`` with string keys not starting with ``$``: a JSON object; any other dict (AdamW's int parameter ids):
  ``{"$map": [[key, value], ...]}`` (insertion order kept).
- ``torch.Tensor``: ``{"$tensor": name}``, the tensor itself (detached, CPU, contiguous copy) in ``tensors``.
- ``numpy.ndarray`` / numpy scalar (fixed-size dtypes): ``{"$ndarray": name, "dtype": "<u4", "shape": [...]}``, the
  raw little/big-endian bytes as a ``uint8`` tensor in ``tensors`` (bit-exact, any numeric or bool dtype); a scalar
  adds ``"scalar": true``.
- ``bytes``: ``{"$bytes": hex}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["JsonTree", "encode", "decode"]

JsonTree: TypeAlias = "None | bool | int | float | str | list[JsonTree] | dict[str, JsonTree]"
"""What ``encode`` gives ``json.dumps``: the state's structure, with markers for what JSON cannot hold."""

_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def encode(obj: object) -> tuple[JsonTree, dict[str, torch.Tensor]]:
    """``(JSON-able tree, {name: tensor})`` for ``obj`` (see the module docstring)."""
    tensors: dict[str, torch.Tensor] = {}
    return _enc(obj, tensors, "state"), tensors


def decode(tree: JsonTree, tensors: Mapping[str, torch.Tensor]) -> object:
    """The object ``encode`` was given, rebuilt from its tree and tensors.

    Raises:
        ValueError: an unknown marker, a missing tensor, or a tensor that does not match its record.
    """
    return _dec(tree, tensors)


def _enc(obj: Any, tensors: dict[str, Any], where: str) -> Any:
    if obj is None or isinstance(obj, (bool, int, str)) and not isinstance(obj, np.generic):
        return obj
    if isinstance(obj, float) and not isinstance(obj, np.generic):
        return obj if math.isfinite(obj) else {"$float": str(obj)}
    if isinstance(obj, list):
        return [_enc(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"$tuple": [_enc(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: _enc(v, tensors, f"{where}.{k}") for k, v in obj.items()}
        return {"$map": [[_enc(k, tensors, f"{where}<key>"), _enc(v, tensors, f"{where}[{k!r}]")]
                         for k, v in obj.items()]}
    if isinstance(obj, bytes):
        return {"$bytes": obj.hex()}
    if isinstance(obj, (np.ndarray, np.generic)):
        arr = np.asarray(obj)
        if arr.dtype.hasobject or arr.dtype.kind not in "biufc":
            raise TypeError(f"{where}: numpy dtype {arr.dtype} cannot be stored (numbers and bools only)")
        name = f"t{len(tensors)}"
        import torch

        raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).copy()
        tensors[name] = torch.from_numpy(raw)
        out: dict[str, Any] = {"$ndarray": name, "dtype": arr.dtype.str, "shape": list(arr.shape)}
        if isinstance(obj, np.generic):
            out["scalar"] = True
        return out
    if type(obj).__module__.startswith("torch") and hasattr(obj, "detach"):
        name = f"t{len(tensors)}"
        tensors[name] = obj.detach().cpu().contiguous().clone()
        return {"$tensor": name}
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be stored in a checkpoint "
                    "(use numbers, strings, lists, dicts, numpy arrays or tensors)")


def _dec(tree: Any, tensors: Mapping[str, Any]) -> Any:
    if isinstance(tree, list):
        return [_dec(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    marker = next((k for k in tree if k.startswith("$")), None)
    if marker is None:
        return {k: _dec(v, tensors) for k, v in tree.items()}
    if marker == "$tuple":
        return tuple(_dec(v, tensors) for v in tree["$tuple"])
    if marker == "$map":
        return {_dec(k, tensors): _dec(v, tensors) for k, v in tree["$map"]}
    if marker == "$float":
        if tree["$float"] not in _FLOATS:
            raise ValueError(f"unknown float {tree['$float']!r}")
        return _FLOATS[tree["$float"]]
    if marker == "$bytes":
        return bytes.fromhex(tree["$bytes"])
    if marker == "$tensor":
        return _tensor(tensors, tree["$tensor"])
    if marker == "$ndarray":
        dtype = np.dtype(tree["dtype"])
        if dtype.hasobject or dtype.kind not in "biufc":
            raise ValueError(f"dtype {dtype} is not a stored numpy dtype")
        raw = _tensor(tensors, tree["$ndarray"])
        shape = tuple(int(x) for x in tree["shape"])
        if str(raw.dtype) != "torch.uint8" or raw.ndim != 1 or raw.numel() != dtype.itemsize * math.prod(shape):
            raise ValueError(f"tensor {tree['$ndarray']!r} does not hold a {dtype} array of shape {shape}")
        arr = raw.numpy().copy().view(dtype).reshape(shape)
        return arr[()] if tree.get("scalar") else arr
    raise ValueError(f"unknown marker {marker!r}")


def _tensor(tensors: Mapping[str, Any], name: Any) -> Any:
    if not isinstance(name, str) or name not in tensors:
        raise ValueError(f"missing tensor {name!r}")
    return tensors[name]
