"""``.ci/run`` runs the ``isa`` tests a second time under a restricted instruction set, so a test whose result depends
on the CPU's kernels fails on any machine, not only on the CPU kind that exposes it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESTRICTED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
KERNEL_DEPENDENT = ["test_embedding_split.py", "test_dtypes_auto.py", "test_results_store.py", "test_bench_learner.py",
                    "test_backend_hf_cache.py"]  # each failed, or read the machine, under the restricted ISA once


def _commands() -> list[list[str]]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [shlex.split(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_isa_marker_under_the_restricted_isa_before_the_readme_command():
    runs = [i for i, c in enumerate(_commands()) if any(c[j:j + 2] == ["-m", "isa"] for j in range(len(c)))]
    assert len(runs) == 1, "one 'pytest -m isa' line in .ci/run"
    cmd = _commands()[runs[0]]
    env = dict(word.split("=", 1) for word in cmd if re.fullmatch(r"[A-Z_]+=\S*", word))
    assert env == RESTRICTED
    readme = next(i for i, c in enumerate(_commands()) if c[-2:] == ["pytest", "-q"])
    assert runs[0] < readme  # runs before README's command, under set -e: a failure fails CI


def test_the_kernel_dependent_modules_carry_the_marker():
    marked = {p.name for p in (ROOT / "tests").glob("test_*.py")
              if re.search(r"^pytestmark = .*pytest\.mark\.isa\b", p.read_text(), re.M)}
    assert set(KERNEL_DEPENDENT) <= marked, set(KERNEL_DEPENDENT) - marked
    assert "isa:" in (ROOT / "pyproject.toml").read_text()  # registered, so --strict-markers would accept it
