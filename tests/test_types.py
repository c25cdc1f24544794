"""Types that say something: mypy, strict, finds nothing in the decision and training packages (the configuration in
pyproject.toml's ``[tool.mypy]``), and no public function or method there takes or returns a bare ``Any``.

A bare ``Any`` is the annotation ``Any`` (or ``typing.Any``) alone, or in a union at the top (``Any | None``,
``Optional[Any]``); ``Any`` nested in a type (``dict[str, Any]``) says what the container is and passes. Public: a
module-level function, or a method of a class, whose name does not start with ``_`` (dunder methods such as
``__init__`` included), in a class whose name does not either or that a public class of its module subclasses.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import sara

ROOT = Path(sara.__file__).parent
REPO = ROOT.parent
STRICT = ("sara/allocators", "sara/samplers", "sara/priors", "sara/driver.py", "sara/flight.py", "sara/step.py", "sara/train")
"""What mypy checks strictly (``[tool.mypy] files``) and what the bare-``Any`` rule covers."""


def _modules() -> list[Path]:
    out: list[Path] = []
    for entry in STRICT:
        path = REPO / entry
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return out


def _expression(node: ast.expr | None) -> ast.expr | None:
    """``node``, or the expression a string annotation holds (None when it does not parse)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    return node


def _is_any(node: ast.expr | None) -> bool:
    """``node`` is ``Any`` / ``typing.Any`` (a string annotation is read as the expression it holds)."""
    node = _expression(node)
    return (isinstance(node, ast.Name) and node.id == "Any") or (isinstance(node, ast.Attribute)
                                                                 and node.attr == "Any")


def _is_bare_any(node: ast.expr | None) -> bool:
    """``node`` is a bare ``Any``, alone or in a union at the top (``Any | None``, ``Optional[Any]``, ``Union[...]``)."""
    node = _expression(node)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _is_bare_any(node.left) or _is_bare_any(node.right)
    if isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)):
        name = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
        if name in ("Optional", "Union"):
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return any(_is_bare_any(x) for x in items)
    return _is_any(node)


def bare_any_signatures(source: str, module: str) -> list[str]:
    """``module:Class.method (parameters)`` of every public function or method of ``source`` that takes or returns a
    bare ``Any``."""
    found: list[str] = []
    tree = ast.parse(source)
    inherited = {b.id for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and not c.name.startswith("_")
                 for b in c.bases if isinstance(b, ast.Name)}  # a private base's methods are the subclass's

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and (not child.name.startswith("_") or child.name in inherited):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                dunder = child.name.startswith("__") and child.name.endswith("__")
                if child.name.startswith("_") and not dunder:
                    continue
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x is not None)]
                bad = [p.arg for p in params if _is_bare_any(p.annotation)]
                bad += ["return"] if _is_bare_any(child.returns) else []
                if bad:
                    found.append(f"{module}:{prefix}{child.name} ({', '.join(bad)})")

    visit(tree, "")
    return found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_bare_any_in_public_signatures():
    found = [hit for path in _modules() for hit in bare_any_signatures(path.read_text(), _module_name(path))]
    assert not found, ("public signatures with a bare Any (give the type: a class, a Protocol, Mapping[str, object], a "
                       "TypeVar, torch.Tensor, np.ndarray, ...):\n" + "\n".join(found))


@pytest.mark.parametrize("annotation", ["Any", "typing.Any", "'Any'", "Any | None", "Optional[Any]",
                                        "Union[int, Any]"])
def test_the_checker_catches_a_bare_any(annotation):
    source = f"import typing\nfrom typing import Any, Optional, Union\n\n\ndef f(x: {annotation}) -> int: ...\n\n\n" \
             f"class C:\n    def g(self) -> {annotation}: ...\n\n    def _h(self, y: {annotation}) -> None: ...\n\n\n" \
             f"class _Base:\n    def __init__(self, z: {annotation}) -> None: ...\n\n\nclass D(_Base): ...\n"
    assert bare_any_signatures(source, "m") == ["m:f (x)", "m:C.g (return)", "m:_Base.__init__ (z)"]


def test_the_checker_lets_nested_any_and_private_names_pass():
    source = ("from typing import Any\n\n\ndef f(x: dict[str, Any], *a: object, **k: list[Any]) -> tuple[Any, int]: ...\n"
              "\n\ndef _g(x: Any) -> Any: ...\n\n\nclass _C:\n    def h(self, x: Any) -> None: ...\n")
    assert bare_any_signatures(source, "m") == []


def test_the_strict_packages_are_mypys():
    """The rule covers what pyproject.toml tells mypy to check."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = REPO / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("sara is not run from its source tree")
    config = tomllib.loads(pyproject.read_text())["tool"]["mypy"]
    assert tuple(config["files"]) == STRICT


@pytest.mark.slow
def test_mypy_strict_finds_nothing():
    """``mypy`` with pyproject.toml's configuration (strict on ``STRICT``) exits 0 (about 20 s cold, then cached)."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("sara is not run from its source tree")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "pyproject.toml"], cwd=REPO,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"mypy found errors:\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}"
