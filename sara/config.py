"""Pydantic config helpers and spec strings (``"name"`` or ``"name:key=value,key=value"``).

Every config model forbids unknown fields, and every validation error is re-raised as ``ConfigError`` naming the
offending field and what to change, e.g.::

    ConfigError: allocator 'sara_paper': field 'tau_low': Input should be less than or equal to 1 (got '1.5')
"""

from __future__ import annotations

import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

__all__ = ["MAX_SEED", "MAX_STEPS", "MIN_TEMPERATURE", "SaraModel", "SaraError", "ConfigError", "check_spec_k", "parse_spec", "validate_config"]

M = TypeVar("M", bound=BaseModel)

MAX_SEED = 2**32 - 1
"""Largest seed a config accepts: seeds are mixed into 64-bit integers (``sara.seeding``), with room for the offsets
added to them (``sara matrix``'s seed + i)."""
MAX_STEPS = 1_000_000
"""Most steps a run or a benchmark counts (``TrainConfig.steps``, ``--steps``), and so the most steps between two of
its checkpoints or evaluations or a streaming carry may span."""
MIN_TEMPERATURE = 0.01
"""Lowest sampling temperature a config accepts. Below it sampling is greedy in all but name (k identical rollouts, a
saturated group), vLLM silently samples at this temperature instead (so the learner's log-probs would not be the
generator's), and logits divided by the temperature overflow in half precision."""


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

    @classmethod
    def option_names(cls) -> list[str]:
        """The options a spec string may give this config, by the names the spec uses (here: its fields)."""
        return list(cls.model_fields)

    @classmethod
    def option_at(cls, loc: Sequence[int | str]) -> str:
        """The option a validation error at ``loc`` (pydantic's path into the data) is about, named as a spec
        names it (here: the path joined by dots)."""
        return ".".join(str(p) for p in loc)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Refuse ``true`` / ``false`` where a number goes (pydantic would read them as 1 / 0)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _bool_for_number(field.annotation, value):
            raise ValueError("true / false where a number goes (a boolean is not 1 or 0); give a number")
        return value


def _members(annotation: Any) -> list[Any]:
    """The types a value of ``annotation`` may be: a union's members (None left out), ``Annotated`` unwrapped."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _members(get_args(annotation)[0])
    if origin is Union or origin is types.UnionType:
        return [m for a in get_args(annotation) for m in _members(a) if m is not type(None)]
    return [annotation]


def _bool_for_number(annotation: Any, value: Any) -> bool:
    """Whether ``value`` holds a bool (at any depth of a list, tuple or mapping) where ``annotation`` takes an
    ``int`` or a ``float`` and no bool."""
    members = _members(annotation)
    if isinstance(value, bool):
        numbers = any(m in (int, float) for m in members)
        takes_bool = any(m in (bool, Any, object) or (get_origin(m) is Literal and any(
            isinstance(a, bool) for a in get_args(m))) for m in members)
        return numbers and not takes_bool
    for m in members:
        origin, args = get_origin(m), get_args(m)
        if origin in (tuple, list, set, frozenset) and isinstance(value, (list, tuple)) and args:
            fixed = origin is tuple and args[-1] is not Ellipsis
            if any(_bool_for_number(args[i] if fixed and i < len(args) else args[0], v) for i, v in enumerate(value)):
                return True
        elif origin is dict and isinstance(value, Mapping) and len(args) == 2:
            if any(_bool_for_number(args[1], v) for v in value.values()):
                return True
    return False


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


def check_spec_k(spec: str, options: Mapping[str, str], k: int, *, what: str) -> None:
    """The one rule for a ``k`` inside an allocator's or sampler's spec: the group size has one source, the run's
    ``k``; a spec may repeat it, never differ from it.

    Args:
        spec: The spec as given (named in the error).
        options: Its parsed options (``parse_spec``).
        k: The run's group size.
        what: ``"allocator"`` or ``"sampler"``.

    Raises:
        ConfigError: the spec's ``k`` is not the run's.
    """
    given = str(options.get("k", k)).strip()
    if given != str(int(k)):
        raise ConfigError(f"{what} {spec!r}: field 'k': {given} disagrees with the run's k={int(k)}; drop k from the "
                          f"{what} spec (the group size comes from the training config's k)")


def validate_config(model: type[M], data: Mapping[str, Any], *, what: str) -> M:
    """Build ``model(**data)``; on failure raise ``ConfigError`` naming every bad field and its value."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        lines = []
        names = sorted(model.option_names() if issubclass(model, SaraModel) else model.model_fields)
        for err in exc.errors():
            field = model.option_at(err["loc"]) if issubclass(model, SaraModel) else ".".join(map(str, err["loc"]))
            got = err.get("input")
            hint = err["msg"].removeprefix("Value error, ")
            if not field:  # a cross-field check: its message names the fields
                lines.append(hint)
                continue
            if err["type"] == "extra_forbidden" and field in model.other_rules:
                other = model.other_rules[field]
                hint = (f"an option of {other!r}, not of this rule; use '{other}:{field}={got}' (options of this "
                        f"rule: {', '.join(names)})")
            elif err["type"] == "extra_forbidden":
                hint = f"unknown option; known options: {', '.join(names)}"
            lines.append(f"field '{field}': {hint} (got {got!r})")
        raise ConfigError(f"{what}: " + "; ".join(lines)) from None
