"""Reading config text: YAML (and JSON, a subset) with the surprises removed, and ``--set`` values.

``load_yaml(text, what=...)`` is ``yaml.safe_load`` (no tags that build objects) plus:

- YAML 1.2 core scalars: ``true`` / ``false`` are the only booleans, integers are decimal (``0x``/``0o`` prefixes
  allowed), floats are decimal or exponent forms (``3e-4``) and ``.inf`` / ``.nan``; YAML 1.1's base-60 numbers
  (``12:30`` = 750), ``yes`` / ``no`` / ``on`` / ``off`` booleans and ``010`` octals are plain strings or decimals;
- a key given twice in one mapping is an error (a ``<<`` merge may still be overridden);
- the value may hold at most ``MAX_NODES`` values counted with repetition (aliases repeat what they point to, so a
  570-byte alias bomb would expand to billions) and nest at most ``MAX_DEPTH`` levels.

Every failure is a one-line ``ConfigError`` that starts with ``what`` (the file, or the ``--set`` item).
``parse_value(raw, what=...)`` reads one ``--set`` value the same way; ``dump_yaml(value)`` writes YAML that
``load_yaml`` reads back. ``read_config(path)`` reads a config file's
text: at most ``MAX_CONFIG_BYTES`` of it, so a huge file or a device (``/dev/zero``) is refused without being read
whole.
"""

from __future__ import annotations

import os
import re
from typing import Any

from sara.config import ConfigError

__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "MAX_NODES", "check_size", "dump_yaml", "load_yaml", "parse_value",
           "read_config"]

MAX_CONFIG_BYTES = 2**20
"""Largest config file, in bytes (1 MiB: room for ``MAX_NODES`` short values)."""
MAX_NODES = 100_000
"""Most values (mapping entries, list items, scalars; repeats counted) one config may expand to."""
MAX_DEPTH = 64
"""Deepest nesting of lists and mappings in a config."""

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                    r"|\.(?:nan|NaN|NAN))$")
_loader: Any = None


def _make_loader() -> Any:
    import yaml
    from yaml.constructor import ConstructorError

    class DuplicateKey(ConstructorError):
        """A mapping gives one key twice."""

    class Loader(yaml.SafeLoader):
        """``SafeLoader`` with YAML 1.2 core scalars and no duplicate keys."""

        yaml_implicit_resolvers = {k: [r for r in v if r[0] not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int",
                                                                     "tag:yaml.org,2002:float")]
                                   for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: set[Any] = set()
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    try:
                        dup = key in seen
                        seen.add(key)
                    except TypeError:
                        continue  # an unhashable key: the base class reports it
                    if dup:
                        raise DuplicateKey("while constructing a mapping", node.start_mark,
                                               f"key {key!r} is given twice", key_node.start_mark)
            return super().construct_mapping(node, deep=deep)

        def construct_yaml_int(self, node: Any) -> int:
            text = self.construct_scalar(node)
            return int(text[2:], 8 if text[1] == "o" else 16) if text[:2] in ("0o", "0x") else int(text)

    for tag, pattern, first in (("bool", _BOOL, "tTfF"), ("int", _INT, "-+0123456789"),
                                ("float", _FLOAT, "-+.0123456789")):
        Loader.add_implicit_resolver(f"tag:yaml.org,2002:{tag}", pattern, list(first))
    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    Loader.DuplicateKey = DuplicateKey
    return Loader


def _parse(text: str) -> Any:
    """``yaml.load`` with the loader above (raises ``yaml.YAMLError`` / ``RecursionError``)."""
    global _loader
    import yaml

    if _loader is None:
        _loader = _make_loader()
    return yaml.load(text, Loader=_loader)  # noqa: S506 - a SafeLoader subclass


def _yaml_error(exc: Any, what: str) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    return ConfigError(f"{what}: not valid YAML{where}: {problem}")


def check_size(value: Any, *, what: str) -> Any:
    """``value`` when it expands to at most ``MAX_NODES`` values nested at most ``MAX_DEPTH`` deep.

    Raises:
        ConfigError: naming ``what`` and the limit.
    """
    stack: list[tuple[Any, int]] = [(value, 0)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ConfigError(f"{what}: expands to more than {MAX_NODES:,} values (a YAML alias repeats what its "
                              "anchor holds); write the values out or use fewer aliases")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{what}: nested more than {MAX_DEPTH} levels deep; flatten it")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
            count += len(node)  # the keys
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
    return value


def read_config(path: str | os.PathLike[str], *, expected: str = "YAML/JSON config file") -> str:
    """The UTF-8 text of the config file ``path``, of which at most ``MAX_CONFIG_BYTES + 1`` bytes are read.

    Raises:
        ConfigError: naming the file: it cannot be read (the message asks for an existing ``expected``), it holds
            more than ``MAX_CONFIG_BYTES`` bytes, or it is not UTF-8.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config {path}: cannot be read ({exc.strerror or exc}); pass an existing {expected}"
                          ) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path}: larger than {MAX_CONFIG_BYTES:,} bytes, the most a config may hold; pass "
                          f"a {expected} (data belongs in the files a task reads)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 YAML or JSON"
                          ) from None


def load_yaml(text: str, *, what: str) -> Any:
    """Parse YAML / JSON ``text`` (see the module docstring).

    Raises:
        ConfigError: invalid YAML (with line and column), a duplicate key, too many values or too deep.
    """
    import yaml

    try:
        value = _parse(text)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, what) from None
    except RecursionError:
        raise ConfigError(f"{what}: nested more than {MAX_DEPTH} levels deep; flatten it") from None
    return check_size(value, what=what)


def parse_value(raw: str, *, what: str) -> Any:
    """One ``--set`` value: YAML 1.2 scalars (``1e-4``, ``true``, ``null``), flow lists and mappings
    (``[0.9, 0.99]``, ``{d_model: 16}``); text that is not valid YAML stays the string it is."""
    import yaml

    if not raw.strip():
        return ""
    try:
        value = _parse(raw)
    except yaml.YAMLError as exc:
        if isinstance(exc, _loader.DuplicateKey):
            raise _yaml_error(exc, what) from None
        return raw
    except RecursionError:
        raise ConfigError(f"{what}: nested more than {MAX_DEPTH} levels deep; flatten it") from None
    return check_size(value, what=what)


def dump_yaml(value: Any, *, one_line: bool = False) -> str:
    """``value`` as YAML (``yaml.safe_dump``, mappings in their own order), without the final newline; ``one_line``:
    on one line, collections in flow style (``[1, 2]``), a scalar without the document-end marker."""
    import yaml

    if not one_line:
        return str(yaml.safe_dump(value, sort_keys=False)).rstrip("\n")
    text = str(yaml.safe_dump(value, sort_keys=False, default_flow_style=True, width=1 << 16))
    return text.rstrip("\n").removesuffix("\n...").strip()
