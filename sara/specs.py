"""Specs as the command line writes them: ``split_specs`` splits ``--allocators``-style lists, and
``parse_allocation`` reads one ``ALLOCATOR[@SAMPLER]`` entry of such a list (``AllocationSpec``).

A single component spec (``name:key=value,...``) is parsed by ``sara.config.parse_spec``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sara.config import ConfigError

__all__ = ["AllocationSpec", "parse_allocation", "split_specs"]


@dataclass(frozen=True)
class AllocationSpec:
    """An ``ALLOCATOR[@SAMPLER]`` spec, split at its ``@``.

    Attributes:
        allocator: The allocator spec (``name[:key=value,...]``), stripped, never empty.
        sampler: The sampler spec after ``@``, stripped; None without ``@`` (the caller's default sampler).
    """

    allocator: str
    sampler: str | None = None

    def sampler_or(self, default: str) -> str:
        """The sampler spec, or ``default`` when the spec names none."""
        return self.sampler if self.sampler is not None else default


def parse_allocation(text: str, *, field: str = "allocators", what: str = "") -> AllocationSpec:
    """Split ``ALLOCATOR[@SAMPLER]`` (``"sara"``, ``"sara:prior=history@predictive:decay=0.9"``) at its ``@``.

    Args:
        text: The spec.
        field: The field or flag the spec came from, named in the error ("" = none: a pydantic validator, whose
            error names its field).
        what: The command or config named first in the error (``"matrix"``), if any.

    Raises:
        ConfigError: an empty allocator, an ``@`` with no sampler after it, or more than one ``@``.
    """
    allocator, at, sampler = (part.strip() for part in str(text).partition("@"))
    if not allocator or (at and not sampler) or "@" in sampler:
        where = "".join(f"{part}: " for part in (what, f"field '{field}'" if field else "") if part)
        raise ConfigError(f"{where}{text!r} must look like ALLOCATOR or ALLOCATOR@SAMPLER, one '@' between two "
                          "non-empty specs (e.g. sara@predictive)")
    return AllocationSpec(allocator, sampler if at else None)


def split_specs(text: str) -> list[str]:
    """Split a list of allocator specs. Specs are separated by ';', or by ',' when the next item starts a new spec
    (contains no '=' before any ':'), so ``ds,sara_paper:tau_low=0.45,probe=1`` is two specs."""
    if ";" in text:
        return [s.strip() for s in text.split(";") if s.strip()]
    specs: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        starts_new = "=" not in item or (":" in item and item.index(":") < item.index("="))
        if specs and not starts_new:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs
