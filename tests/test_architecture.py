"""The house rules, checked: dependencies point one way (a lower layer never imports a higher one), every module
under ``sara/`` stays within 400 lines, no deprecation shims, and one driver.

Layers, lowest first (a module may import its own layer and the ones below):

0. core: types, units, config, configfile, specs, registry, seeding, timing, memory, storage, handles, data, machine
1. priors: how hard a prompt is (population priors, per-prompt history, posteriors)
2. decisions, algorithms and environments: samplers, allocators, algos, envs (tasks, simulators, task envs), metrics,
   hub
3. models and engines: policies, backends
4. the driver and the allocation builder: driver, flight, step, build
5. training: train
6. users' entry points: bench, experiments, testing, commands, cli, integrations

Within layer 2, samplers, allocators, algos and envs never import each other; within layer 3, policies never import
backends. Imports inside functions count, and so do lazy ``"sara.module:attr"`` registry entries.

No two modules import each other, directly or through others (no import cycle, imports inside functions and under
``TYPE_CHECKING`` included): ``from package import submodule`` counts as importing the submodule, and registry entries
(``"sara.module:attr"`` strings) do not count here, because a registry resolves them by name on first lookup, after
both modules are loaded (``sara/Mixture-v0``'s components are looked up in the very registry that names it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sara

ROOT = Path(sara.__file__).parent

LAYERS: dict[str, int] = {
    "sara.types": 0, "sara.units": 0, "sara.config": 0, "sara.registry": 0, "sara.seeding": 0, "sara.timing": 0,
    "sara.memory": 0, "sara.storage": 0, "sara.handles": 0, "sara.data": 0, "sara.configfile": 0, "sara.machine": 0, "sara.specs": 0,
    "sara.hf_kernels": 0,
    "sara.priors": 1,
    "sara.samplers": 2, "sara.allocators": 2, "sara.algos": 2, "sara.envs": 2, "sara.metrics": 2, "sara.hub": 2,
    "sara.policies": 3, "sara.backends": 3,
    "sara.driver": 4, "sara.flight": 4, "sara.step": 4, "sara.build": 4,
    "sara.train": 5,
    "sara.bench": 6, "sara.experiments": 6, "sara.testing": 6, "sara.commands": 6, "sara.cli": 6,
    "sara.integrations": 6,
}
# Pairs in the same layer that must not depend on each other: (importer prefix, imported prefix).
ROOMS = ("sara.samplers", "sara.allocators", "sara.algos", "sara.envs")
FORBIDDEN = [(a, b) for a in ROOMS for b in ROOMS if a != b] + [("sara.policies", "sara.backends")]
# The package root re-exports the public API.
EXEMPT = {"sara"}
# Packages that import their members on first use (``__getattr__``), so importing them stays light.
LAZY = {"sara.backends.ray", "sara.testing"}
# Modules that call an allocator's protocol directly rather than through the driver: the decision-throughput
# benchmark times those calls themselves, and the conformance kit's boundary leg makes bad calls on purpose.
DRIVES_ALLOCATORS = {"sara.driver", "sara.bench.decisions", "sara.testing.boundary"}


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


def code_imports(source: str, module: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` imports in code: ``imports_of`` less the registry entries, a name
    imported from a package resolved to its submodule when it is one (``from sara.train import checkpoint``)."""
    sara_modules = imports_of(source, module)
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module in sara_modules:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            found |= subs | ({node.module} if len(subs) < len(node.names) else set())
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names} & sara_modules
    return {m for m in found if m in known and m != module}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles():
    known = {module_name(path) for path in MODULES}
    graph = {module_name(p): code_imports(p.read_text(encoding="utf-8"), module_name(p), known) for p in MODULES}
    cycles = import_cycles(graph)
    assert not cycles, "modules that import each other (move what they share below both):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("sources", [
    {"sara.a": "from sara.b import x\n", "sara.b": "def f():\n    from sara.a import y\n"},       # inside a function
    {"sara.a": "import sara.b\n", "sara.b": "from sara import c\n", "sara.c": "from sara.a import z\n"},  # via one more
    {"sara.p": "from sara.p import m\n", "sara.p.m": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
     "    from sara.p import T\n"},                                                             # a type-only import
])
def test_the_cycle_checker_catches_a_cycle(sources):
    graph = {m: code_imports(src, m, set(sources)) for m, src in sources.items()}
    assert import_cycles(graph) == [sorted(sources)]


def test_the_cycle_checker_lets_a_registry_name_its_entry():
    sources = {"sara.tasks": "REG = {'mix': 'sara.tasks.mix:make'}\n", "sara.tasks.mix": "from sara.tasks import REG\n"}
    graph = {m: code_imports(src, m, set(sources)) for m, src in sources.items()}
    assert graph == {"sara.tasks": set(), "sara.tasks.mix": {"sara.tasks"}} and not import_cycles(graph)


def test_dependencies_point_one_way():
    found = [v for path in MODULES for v in violations(module_name(path), path.read_text(encoding="utf-8"))]
    assert not found, "backwards imports:\n" + "\n".join(found)


@pytest.mark.parametrize("module, source", [
    ("sara.allocators.fake", "from sara.train import Trainer\n"),                     # a higher layer
    ("sara.allocators.fake", "def f():\n    import sara.driver\n"),                    # inside a function
    ("sara.allocators.fake", "from sara.envs.sim import SimulatedEnv\n"),             # a forbidden sibling
    ("sara.policies.fake", "REG = 'sara.backends.tiny:make_tiny_backend'\n"),          # a lazy entry point
    ("sara.types", "from sara.allocators import ALLOCATORS\n"),                       # core importing up
    ("sara.newroom", "import numpy\n"),                                               # an unassigned module
    ("sara.samplers.fake", "from sara.allocators import SARAAllocator\n"),           # samplers never need allocators
    ("sara.priors.fake", "from sara.samplers import UniformSampler\n"),              # priors sit below samplers
])
def test_the_checker_catches_a_backwards_import(module, source):
    assert violations(module, source)


def test_the_checker_accepts_downward_imports():
    assert not violations("sara.train.trainer", "from sara.driver import collect\nfrom sara.types import Group\n")
    assert not violations("sara.backends.tiny", "from sara.policies.tiny import TinyPolicy\n")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_modules_stay_small(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= 400, f"{path.relative_to(ROOT.parent)} has {lines} lines (limit 400): split it by responsibility"


def _module_getattr(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_deprecation_shims(path):
    """No module keeps old names alive: no module-level ``__getattr__`` outside the lazy packages, no deprecation
    warnings."""
    source = path.read_text(encoding="utf-8")
    name = module_name(path)
    assert "DeprecationWarning" not in source, f"{name} warns about a deprecated name"
    assert name in LAZY or not _module_getattr(ast.parse(source)), f"{name} resolves names through __getattr__"


def _calls(tree: ast.Module, method: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == method
               for n in ast.walk(tree))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_one_driver(path):
    """Only ``sara.driver`` runs the collection loop: no other module dispatches rollouts and delivers results to an
    allocator (``dispatch`` + ``finished``); everything else calls ``sara.driver.collect``."""
    name = module_name(path)
    if name.startswith("sara.allocators") or name in DRIVES_ALLOCATORS:
        return
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assert not (_calls(tree, "dispatch") and _calls(tree, "finished")), f"{name} runs its own collection loop"


def test_the_driver_checks_catch_a_second_loop_and_a_shim():
    loop = ast.parse("def run(a, env):\n    ids = a.dispatch(8)\n    a.finished(ids, env.go(ids))\n")
    assert _calls(loop, "dispatch") and _calls(loop, "finished")
    assert _module_getattr(ast.parse("def __getattr__(name):\n    return 1\n"))


def private_imports(source: str) -> list[str]:
    """Private names (``_name``, not dunders) a module imports from another sara module."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sara"):
            found += [f"{node.module}.{a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_crosses_a_module():
    """A module's private names stay its own: what another module needs is public (named, documented)."""
    crossing = {module_name(p): private_imports(p.read_text()) for p in sorted(ROOT.rglob("*.py"))}
    assert not {m: names for m, names in crossing.items() if names}


def test_the_private_import_check_sees_one():
    assert private_imports("from sara.backends.ray.base import RayPool, _last_line\n") == [
        "sara.backends.ray.base._last_line"]
    assert private_imports("from sara.backends.text import render_chat as _render_chat\n") == []
