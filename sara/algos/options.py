"""Option validation shared by the algorithm specs and the advantage estimators (pydantic, ``ConfigError`` texts).

- ``estimator_params_model(fn)``: a pydantic model of an estimator's keyword-only options, built from its signature
  (``Annotated[float, Field(ge=0, le=1)]`` annotations carry the ranges).
- ``errors_text(exc, model)``: ``field 'lam': Input should be ...; valid range [0, 1] (got '2')`` per error.
- ``none_strings(model, data)``: ``"none"`` from a spec string becomes ``None`` where the field admits it.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any

import annotated_types
from pydantic import ValidationError, create_model, model_validator
from pydantic.fields import FieldInfo

from sara.config import SaraModel

__all__ = ["EstimatorParams", "errors_text", "estimator_params_model", "none_strings", "valid_range"]


def none_strings(model: type[SaraModel], data: Any) -> Any:
    """``data`` with ``"none"`` strings (spec strings, the command line) turned into ``None`` where a field admits it."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for key, value in data.items():
        info = model.model_fields.get(key)
        if info is None or not isinstance(value, str) or value.strip().lower() not in ("none", "null"):
            continue
        if info.annotation is Any or type(None) in typing.get_args(info.annotation):
            out[key] = None
    return out


class EstimatorParams(SaraModel):
    """Base of the options models ``estimator_params_model`` builds (``"none"`` strings become ``None``)."""

    @model_validator(mode="before")
    @classmethod
    def _none_strings(cls, data: Any) -> Any:
        return none_strings(cls, data)


@functools.cache
def estimator_params_model(fn: Callable[..., Any]) -> type[EstimatorParams]:
    """A pydantic model of ``fn``'s keyword-only parameters: their annotations (with ``Field`` ranges) and defaults.

    An unresolvable or missing annotation falls back to the default's type (``Any`` without a default); a parameter
    without a default is required.
    """
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # a user estimator with forward references we cannot resolve
        hints = {}
    fields: dict[str, Any] = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        default = ... if p.default is inspect.Parameter.empty else p.default
        fallback = Any if default is ... or default is None else type(default)
        fields[p.name] = (hints.get(p.name, fallback), default)
    name = getattr(fn, "__name__", type(fn).__name__).strip("_") or "estimator"
    return create_model(f"{name}_params", __base__=EstimatorParams, **fields)


def valid_range(info: FieldInfo | None) -> str:
    """``"[0, 1]"``, ``"(0, 1]"``, ``"> 0"``, ... from a field's ``Ge``/``Gt``/``Le``/``Lt`` constraints ("" if none)."""
    lo = hi = None
    for m in info.metadata if info is not None else ():
        if isinstance(m, annotated_types.Ge):
            lo = ("[", ">=", m.ge)
        elif isinstance(m, annotated_types.Gt):
            lo = ("(", ">", m.gt)
        elif isinstance(m, annotated_types.Le):
            hi = ("]", "<=", m.le)
        elif isinstance(m, annotated_types.Lt):
            hi = (")", "<", m.lt)
    if lo and hi:
        return f"{lo[0]}{lo[2]:g}, {hi[2]:g}{hi[0]}"
    bound = lo or hi
    return f"{bound[1]} {bound[2]:g}" if bound else ""


def errors_text(exc: ValidationError, model: type[SaraModel]) -> str:
    """One ``field 'x': message; valid range ... (got ...)`` per error (model-level messages name their field)."""
    parts = []
    for err in exc.errors():
        if not err["loc"]:
            parts.append(err["msg"].removeprefix("Value error, "))
            continue
        field = str(err["loc"][0])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = f"unknown option; known options: {', '.join(sorted(model.model_fields))}"
        elif rng := valid_range(model.model_fields.get(field)):
            msg = f"{msg}; valid range {rng}"
        parts.append(f"field {field!r}: {msg} (got {err.get('input')!r})")
    return "; ".join(parts)
