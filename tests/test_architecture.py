"""The house rules, checked: dependencies point one way (a lower layer never imports a higher one), and every
module under ``sara/`` stays within 400 lines.

Layers, lowest first (a module may import its own layer and the ones below):

0. core: types, config, registry, seeding, timing, storage, handles, deprecation, data
1. decisions, algorithms and environments: allocators, algos, envs (tasks, simulators, task envs), metrics, hub
2. models and engines: policies, backends
3. drivers: collect, collect_async, collect_stream
4. training: train
5. users' entry points: bench, testing, commands, cli, integrations

Within layer 1, allocators, algos and envs never import each other; within layer 2, policies never import backends.
Imports inside functions count, and so do lazy ``"sara.module:attr"`` registry entries.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sara

ROOT = Path(sara.__file__).parent

LAYERS: dict[str, int] = {
    "sara.types": 0, "sara.config": 0, "sara.registry": 0, "sara.seeding": 0, "sara.timing": 0, "sara.storage": 0,
    "sara.handles": 0, "sara.deprecation": 0, "sara.data": 0,
    "sara.allocators": 1, "sara.algos": 1, "sara.envs": 1, "sara.metrics": 1, "sara.hub": 1,
    "sara.policies": 2, "sara.backends": 2,
    "sara.collect": 3, "sara.collect_async": 3, "sara.collect_stream": 3,
    "sara.train": 4,
    "sara.bench": 5, "sara.testing": 5, "sara.commands": 5, "sara.cli": 5, "sara.integrations": 5,
}
# Pairs in the same layer that must not depend on each other: (importer prefix, imported prefix).
FORBIDDEN = [
    ("sara.allocators", "sara.envs"), ("sara.allocators", "sara.algos"),
    ("sara.envs", "sara.allocators"), ("sara.envs", "sara.algos"),
    ("sara.algos", "sara.allocators"), ("sara.algos", "sara.envs"),
    ("sara.policies", "sara.backends"),
]
# The package root re-exports the public API.
EXEMPT = {"sara"}
# Old module paths kept for users: they resolve moved names lazily (``sara.deprecation.moved``) and import nothing else.
ALIASES = {"sara.checkpoint", "sara.models", "sara.envs.backends", "sara.envs.simulated"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> tuple[str, int] | None:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    return (best, LAYERS[best]) if best else None


def imports_of(source: str, module: str) -> set[str]:
    """Every ``sara...`` module ``source`` imports (anywhere in the file) or names as a ``"module:attr"`` entry."""
    found: set[str] = set()
    is_pkg_init = False  # relative imports are not used in this code base; resolve them anyway
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")[: len(module.split(".")) - node.level + (1 if is_pkg_init else 0)]
                base = ".".join([*pkg, base] if base else pkg)
            if base.startswith("sara"):
                found.add(base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("sara"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            head, sep, attr = node.value.partition(":")
            if sep and head.startswith("sara.") and head.replace(".", "").replace("_", "").isalnum() and attr:
                found.add(head)
    return found


def violations(module: str, source: str) -> list[str]:
    """Backwards imports of ``module`` (empty when it follows the layer rules)."""
    if module in EXEMPT:
        return []
    if module in ALIASES:
        extra = imports_of(source, module) - {"sara.deprecation"}
        return [f"{module} is a deprecated alias and may import only sara.deprecation, not {sorted(extra)}"] if extra else []
    own = layer_of(module)
    if own is None:
        return [f"{module}: not assigned to a layer (add it to LAYERS in tests/test_architecture.py)"]
    out = []
    for dep in sorted(imports_of(source, module)):
        other = layer_of(dep)
        if other is None or dep == module:
            continue
        if other[1] > own[1]:
            out.append(f"{module} (layer {own[1]}) imports {dep} (layer {other[1]})")
        for a, b in FORBIDDEN:
            if own[0] == a and other[0] == b:
                out.append(f"{module} imports {dep}: {a} never depends on {b}")
    return out


MODULES = sorted(ROOT.rglob("*.py"))


def test_dependencies_point_one_way():
    found = [v for path in MODULES for v in violations(module_name(path), path.read_text(encoding="utf-8"))]
    assert not found, "backwards imports:\n" + "\n".join(found)


@pytest.mark.parametrize("module, source", [
    ("sara.allocators.fake", "from sara.train import Trainer\n"),                     # a higher layer
    ("sara.allocators.fake", "def f():\n    import sara.collect\n"),                   # inside a function
    ("sara.allocators.fake", "from sara.envs.sim import SimulatedEnv\n"),             # a forbidden sibling
    ("sara.policies.fake", "REG = 'sara.backends.tiny:make_tiny_backend'\n"),          # a lazy entry point
    ("sara.types", "from sara.allocators import ALLOCATORS\n"),                       # core importing up
    ("sara.newroom", "import numpy\n"),                                               # an unassigned module
    ("sara.checkpoint", "from sara.train.checkpoint import save_checkpoint\n"),      # an alias importing eagerly
])
def test_the_checker_catches_a_backwards_import(module, source):
    assert violations(module, source)


def test_the_checker_accepts_downward_imports():
    assert not violations("sara.train.trainer", "from sara.collect import collect\nfrom sara.types import Group\n")
    assert not violations("sara.backends.tiny", "from sara.policies.tiny import TinyPolicy\n")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_modules_stay_small(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 400, f"{path.relative_to(ROOT.parent)} has {lines} lines (limit 400): split it by responsibility"
