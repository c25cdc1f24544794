"""Data files are untrusted: whatever bytes a ``.jsonl`` / ``.json`` holds, building a dataset task gives a task or a
one-line ``ConfigError`` naming the file; never another exception (non-UTF-8, bad JSON, 200,000-deep nesting,
5,000-digit numbers, records of the wrong shape)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sara.config import ConfigError
from sara.envs.tasks import make_task

TASKS = ["sara/GSM8K-v0", "sara/MATH-v0", "sara/AIME-v0"]


def _build(task: str, path) -> object:
    try:
        return make_task(task, path=str(path))
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg and msg.startswith(f"task {task!r}: "), msg
        return exc


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize(("suffix", "data", "fails"), [
    (".json", b"{not json", TASKS), (".json", b"\xff\xfe[]", TASKS),
    (".jsonl", b'{"question": "q", "answer": "#### 1"}\n\xff\n', TASKS),
    (".jsonl", b"[" * 200_000 + b"]" * 200_000, TASKS), (".json", b"[" * 200_000 + b"]" * 200_000, TASKS),
    (".jsonl", b'{"question": "q", "problem": "q", "answer": ' + b"7" * 5000 + b"}\n", TASKS),  # int-to-str limit
    (".jsonl", b'{"question": "q", "problem": "q", "answer": "' + b"7" * 5000 + b'"}\n', TASKS[::2]),
    (".jsonl", b'{"question": "q", "problem": "q", "answer": ' + b"7" * 4000 + b"}\n", TASKS[::2]),
    (".jsonl", b'{"question": "q", "answer": "#### 1,2,3"}\n', TASKS[::2]), (".json", b'{"a": 1}', TASKS),
    (".jsonl", b"1\n", TASKS), (".jsonl", b'{"question": 1, "answer": null}\n', TASKS),
    (".jsonl", b'{"question": "q", "problem": "q", "answer": true}\n', TASKS),
])
def test_a_hostile_data_file_is_one_line(tmp_path, task, suffix, data, fails):
    path = tmp_path / f"data{suffix}"
    path.write_bytes(data)
    built = _build(task, path)
    assert isinstance(built, ConfigError) == (task in fails), built


JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10**50, 10**50), st.floats(), st.text(max_size=20)),
                    lambda inner: st.one_of(st.lists(inner, max_size=4),
                                            st.dictionaries(st.sampled_from(["question", "answer", "problem",
                                                                             "solution", "id", "level", "x"]),
                                                            inner, max_size=4)), max_leaves=12)
RECORD = st.fixed_dictionaries({}, optional={"question": JSON, "problem": JSON, "answer": JSON, "solution": JSON,
                                             "id": JSON})


@settings(max_examples=120, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(task=st.sampled_from(TASKS), records=st.lists(st.one_of(RECORD, JSON), min_size=1, max_size=4),
       junk=st.one_of(st.none(), st.binary(max_size=12)), as_list=st.booleans())
def test_any_data_file_gives_a_task_or_a_one_line_error(tmp_path, task, records, junk, as_list):
    if as_list:
        path, data = tmp_path / "d.json", json.dumps(records).encode()
    else:
        path, data = tmp_path / "d.jsonl", b"\n".join(json.dumps(r).encode() for r in records)
    path.write_bytes(data + (junk or b""))
    built = _build(task, path)
    if not isinstance(built, ConfigError):  # every prompt has its gold, which the verifier reads
        for p in built.prompts:
            assert built.score("", p) == 0.0


def test_a_bad_data_file_through_the_cli_is_one_line(tmp_path, capsys):
    from sara.cli import main

    path = tmp_path / "d.json"
    path.write_bytes(b"[" * 200_000)
    rc = main(["train", "--set", f"task=sara/GSM8K-v0:path={path}", "--out", str(tmp_path / "run")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "invalid JSON (nested too deeply)" in err[0], err
