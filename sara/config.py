"""Pydantic config helpers and spec strings (``"name"`` or ``"name:key=value,key=value"``).

Every config model forbids unknown fields, and every validation error is re-raised as ``ConfigError`` naming the
offending field and what to change, e.g.::

    ConfigError: allocator 'sara_paper': field 'tau_low': Input should be less than or equal to 1 (got '1.5')
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["SaraModel", "SaraError", "ConfigError", "parse_spec", "validate_config"]

M = TypeVar("M", bound=BaseModel)


class SaraError(Exception):
    """An error the user can act on (an invalid value, an unusable checkpoint, a failing verifier); the ``sara``
    command prints its one-line message instead of a traceback."""


class ConfigError(SaraError, ValueError):
    """An invalid configuration value; the message names the field."""


class SaraModel(BaseModel):
    """Base for every config: unknown fields are errors, assignments are validated, docstrings document fields, and a
    float field refuses ``nan`` / ``inf`` (no setting is meaningful there)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True, frozen=False,
                              allow_inf_nan=False)
    other_rules: ClassVar[Mapping[str, str]] = {}
    """Options that belong to another registered rule, mapped to its name: giving one here is an error that names
    the spec to use instead (a name always means one rule)."""


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``"name:key=value,key=value"`` into ``(name, {key: value})`` (values stay strings; the config coerces).

    A ``"module:attr"`` entry point (no ``=`` after the colon) is kept whole as the name; entry points with options
    use ``"module:attr:key=value"``.
    """
    spec = spec.strip()
    if not spec:
        raise ConfigError("empty spec; expected 'name' or 'name:key=value,...'")
    head, _, tail = spec.rpartition(":")
    if not _ or "=" not in tail:
        return spec, {}
    name = head
    kwargs: dict[str, str] = {}
    for item in tail.split(","):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"spec {spec!r}: option {item!r} must look like key=value")
        key = key.strip()
        if key in kwargs:
            raise ConfigError(f"spec {spec!r}: option {key!r} given twice")
        kwargs[key] = value.strip()
    return name, kwargs


def validate_config(model: type[M], data: Mapping[str, Any], *, what: str) -> M:
    """Build ``model(**data)``; on failure raise ``ConfigError`` naming every bad field and its value."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            got = err.get("input")
            hint = err["msg"].removeprefix("Value error, ")
            if not field:  # a cross-field check: its message names the fields
                lines.append(hint)
                continue
            if err["type"] == "extra_forbidden" and field in model.other_rules:
                other = model.other_rules[field]
                hint = (f"an option of {other!r}, not of this rule; use '{other}:{field}={got}' (options of this "
                        f"rule: {', '.join(sorted(model.model_fields))})")
            elif err["type"] == "extra_forbidden":
                known = ", ".join(sorted(model.model_fields))
                hint = f"unknown option; known options: {known}"
            lines.append(f"field '{field}': {hint} (got {got!r})")
        raise ConfigError(f"{what}: " + "; ".join(lines)) from None
