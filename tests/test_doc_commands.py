"""Every shell command of README.md and docs/*.md runs as pasted, in document order, in one fresh directory.

The command blocks (```bash / sh / shell / console) are split into commands (a ``\\`` continues a line; comment lines
go; ``NAME=value`` lines are kept for the commands after them in their block). Each command runs under ``bash`` with
the test environment's ``sara`` and ``python`` first on ``PATH``, in one temporary directory shared by all of them
(what a new user has after ``git clone``: the repository's ``examples/`` copied in), so two commands that write the
same run directory collide here as they would for the user. The prepared models and warm starts are found through
``SARA_CACHE_DIR`` (the real cache). A command that installs packages is skipped; a slow one must be listed in
``SLOW`` with its reason, and is reported as skipped; any other command must finish within ``FAST_SECONDS``. An
entry of ``SLOW`` that matches no command fails, so the list follows the docs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = {"bash", "sh", "shell", "console"}
FAST_SECONDS = 90
"""A command not listed in ``SLOW`` that runs longer fails (on 2 CPU cores; the listed ones take minutes)."""

_MATRIX = "a training matrix: many runs of minutes each"
_SMOLLM2 = "trains or samples SmolLM2-135M on CPU: minutes"
SLOW: list[tuple[str, str, str]] = [
    # (document, a fragment of the command, why it is not run here)
    ("README.md", "--config examples/configs/smollm2_learn.yaml", _MATRIX),
    ("README.md", "sara train --set allocator=ds", "an 80-step run, over a minute on one core (tests/"
                                                   "test_cli_train_outputs.py runs sara train)"),
    ("backends.md", "smollm2_hf.yaml", _SMOLLM2),
    ("backends.md", "smollm2_vllm.yaml", "needs vLLM and SmolLM2"),
    ("integrations.md", "examples/trl_async_grpo.py", "TRL training of SmolLM2 (tests/test_integrations_trl_example"
                                                      ".py runs it on a stand-in model)"),
    ("ray.md", "--ray", "starts a Ray cluster and trains: minutes (tests/test_ray_*.py)"),
    ("ray.md", "sara[vllm,ray]", "a multi-node cluster with GPUs"),
    ("results.md", "sara matrix", _MATRIX),
    ("results.md", "sara bench population", _SMOLLM2),
    ("results.md", "sara train", "80-step runs, a minute or more each"),
    ("results.md", "sara bench ds-estimate", "trains every allocator and DS for each seed: minutes"),
    ("results.md", "python examples/train_custom_task.py", "a warm start and 20 steps (tests/"
                                                           "test_example_train_custom_task.py runs it)"),
    ("results.md", "sara bench allocation --population features:informative", "8 steps x 5 allocators x 3 seeds "
                                                                               "of 512 groups: about a minute"),
    ("results.md", "sara bench allocation --pool-size 4096", "several epochs x 11 allocators: minutes"),
    ("results.md", "python -c", "simulator comparisons of many steps: minutes"),
    ("results.md", "sara bench generation", "streaming benchmarks over seeds and engines: minutes"),
    ("results.md", "sara bench stream --backend hf --task", "SmolLM2 on CPU, about a minute (tests/"
                                                            "test_bench_cli.py runs the bench)"),
    ("results.md", "--backend vllm", "needs vLLM and SmolLM2"),
    ("results.md", "sara bench stream --backend hf:device=cuda", "needs a CUDA GPU"),
    ("results.md", "--backend hf:$o", "SmolLM2 at reasoning length on CPU, both ways: minutes (tests/"
                                      "test_backend_hf_packed.py checks the packed engine on a stand-in model)"),
    ("results.md", "sara bench ray", "starts a Ray cluster"),
    ("results.md", "examples/trl_async_grpo.py", "TRL training of SmolLM2: minutes"),
    ("results.md", "sara bench learner", "SmolLM2 updates, naive and shipped: minutes"),
    ("results.md", "bash .ci/verl", "builds verl's environment (minutes, 2 GB) and runs the verl tests"),
    ("training.md", "sara train --config my.yaml", "a 300-step warm start and 80 steps: minutes"),
    ("training.md", "sara matrix --algos \"grpo;ppo\"", _MATRIX),
    ("verl.md", "bash .ci/verl", "builds verl's environment (minutes, 2 GB) and runs the verl tests"),
    ("verl.md", "run_qwen2_5_gsm8k.sh", "GRPO on GSM8K with verl: needs GPUs"),
]


def _commands(text: str) -> list[tuple[int, str]]:
    """(line, command) of every shell command of a markdown text; a command carries the ``NAME=value`` lines before
    it in its block."""
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        if m.group(1) not in LANGS:
            continue
        first = text[: m.start()].count("\n") + 2
        assigns: list[str] = []
        lines = m.group(2).split("\n")
        i = 0
        while i < len(lines):
            start, cmd = i, lines[i]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + lines[i]
            i += 1
            stripped = cmd.strip()
            if not stripped or stripped.startswith("#"):
                continue
            if re.fullmatch(r"[A-Za-z_]\w*=(\"[^\"]*\"|'[^']*'|\S*)", stripped):
                assigns.append(stripped)
                continue
            out.append((first + start, "\n".join([*assigns, stripped])))
    return out


def _params() -> list:
    params = []
    for doc in DOCS:
        name = doc.relative_to(ROOT).as_posix()
        for line, cmd in _commands(doc.read_text(encoding="utf-8")):
            marks = []
            if re.search(r"\bpip install\b", cmd):
                marks.append(pytest.mark.skip(reason="installs packages"))
            else:
                why = [r for d, frag, r in SLOW if name.endswith(d) and frag in cmd]
                if why:
                    marks.append(pytest.mark.skip(reason=f"slow, listed in SLOW: {why[0]}"))
            short = cmd.splitlines()[-1][:60]
            params.append(pytest.param(cmd, id=f"{name}:{line}: {short}", marks=marks))
    return params


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """One fresh directory for every command: the repository's examples/ in it, nothing else."""
    root = tmp_path_factory.mktemp("fresh-clone")
    shutil.copytree(ROOT / "examples", root / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.parametrize("cmd", _params())
def test_doc_command_runs_as_pasted(cmd, workdir):
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")]), "MPLBACKEND": "Agg",
           "SARA_CACHE_DIR": os.environ.get("SARA_CACHE_DIR") or str(Path.home() / ".cache" / "sara")}
    started = time.perf_counter()
    try:
        proc = subprocess.run(["bash", "-c", f"set -eo pipefail\n{cmd}"], cwd=workdir, env=env, capture_output=True,
                              text=True, timeout=FAST_SECONDS, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ran past {FAST_SECONDS} s: list it in SLOW with its reason, or make it faster: {cmd}")
    seconds = time.perf_counter() - started
    assert proc.returncode == 0, f"exit {proc.returncode} after {seconds:.0f} s: {cmd}\n{proc.stderr[-3000:]}"


def test_every_slow_entry_names_a_command():
    commands = {doc.relative_to(ROOT).as_posix(): [c for _, c in _commands(doc.read_text(encoding="utf-8"))]
                for doc in DOCS}
    stale = [(d, frag) for d, frag, _ in SLOW
             if not any(name.endswith(d) and frag in c for name, cmds in commands.items() for c in cmds)]
    assert not stale, f"SLOW entries that match no command of the docs (remove them): {stale}"


def test_no_two_run_commands_write_the_same_default_directory():
    # A skipped command is not run here, so two identical `sara train` / `matrix` / `bench allocation` commands would
    # collide unseen (the second is refused: its run directory holds the first's run); one of them passes --out.
    seen: dict[str, str] = {}
    dupes = []
    for doc in DOCS:
        for line, cmd in _commands(doc.read_text(encoding="utf-8")):
            words = " ".join(re.sub(r"\s#.*", "", cmd.splitlines()[-1]).split())
            if re.match(r"sara (train|matrix|bench allocation)\b", words) and not re.search(r"--(out|overwrite)\b",
                                                                                           words):
                where = f"{doc.name}:{line}"
                if words in seen:
                    dupes.append(f"{seen[words]} and {where}: {words[:80]}")
                seen.setdefault(words, where)
    assert not dupes, dupes


def test_commands_are_split_as_bash_reads_them():
    text = ("intro\n\n```bash\nP=\"x;y\"\n# a comment\nsara a --b \\\n  --c \"$P\"   # trailing\n\nsara d\n```\n"
            "```python\nprint(1)\n```\n```\nplain text, not a command\n```\n")
    assert _commands(text) == [(6, 'P="x;y"\nsara a --b   --c "$P"   # trailing'), (9, 'P="x;y"\nsara d')]
