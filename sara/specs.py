"""Lists of specs as the command line writes them: ``split_specs`` splits ``--allocators``-style lists.

A single spec (``name:key=value,...``) is parsed by ``sara.config.parse_spec``.
"""

from __future__ import annotations

__all__ = ["split_specs"]


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
