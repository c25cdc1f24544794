"""Every ```python snippet of README.md and docs/*.md runs as pasted (each in a fresh interpreter, from an empty
directory). Snippets that need Ray run under the ``ray`` marker, those that generate with the tiny policy under
``slow``; those that need TRL or a real model, and the signature sketches whose arguments are ``...``, are listed as
skipped with the reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _snippets() -> list:
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            line = text[: m.start()].count("\n") + 1
            code = m.group(1)
            marks = []
            if "trl" in code or "resolve_model" in code or "HFBackend(" in code:
                marks.append(pytest.mark.skip(reason="needs TRL or a real model"))
            elif re.search(r"=\.\.\.|\(\.\.\.\)", code):
                marks.append(pytest.mark.skip(reason="a signature sketch (arguments are ...)"))
            elif "sara.backends.ray" in code:
                marks.append(pytest.mark.ray)
            elif 'POLICIES.get("tiny")' in code or "pool_outcomes" in code or "Trainer(" in code:
                marks.append(pytest.mark.slow)  # warm-starts (or loads) the tiny policy and generates / trains
            out.append(pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}", marks=marks))
    return out


@pytest.mark.parametrize("code", _snippets())
def test_snippet_runs_as_pasted(code, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
