"""examples/custom_task.py runs end to end (registration by entry point, check_task with gymnasium env_checker)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_custom_task_example_runs() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_task.py")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "check_task: ok" in out.stdout
