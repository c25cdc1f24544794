"""Dataset-backed tasks from a parquet file and from an offline Hugging Face ``datasets`` source (no download)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sara.config import ConfigError
from sara.envs.tasks import make_task
from sara.envs.tasks.data import load_records

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

GSM = [{"question": f"What is {i} + {i}?", "answer": f"Add them.\n#### {2 * i:,}"} for i in range(1, 40)]


def test_parquet_records_and_task(tmp_path: Path) -> None:
    path = tmp_path / "gsm.parquet"
    pq.write_table(pa.Table.from_pylist(GSM), path)
    assert load_records(path, what="test") == GSM
    task = make_task("sara/GSM8K-v0", path=str(path), eval_size=5)
    assert len(task.prompts) == 34 and len(task.eval_prompts) == 5
    assert task.prompts[0].answer == {"answer": "2"} and task.eval_prompts[-1].answer == {"answer": "78"}
    assert task.verifier("so the total is #### 2", **task.prompts[0].answer) == 1.0


def test_corrupt_parquet_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="bad.parquet"):
        load_records(bad, what="test")


def test_hf_dataset_offline_from_a_local_dataset_directory(tmp_path: Path) -> None:
    """A clean interpreter (``datasets`` reads its offline switches at import): a local dataset directory loads
    offline through ``hf_dataset``; a name that is not cached fails with a ConfigError, and nothing is downloaded."""
    pytest.importorskip("datasets")
    data = tmp_path / "gsm_local"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM[:30]))
    (data / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GSM[30:]))
    script = textwrap.dedent(f"""
        import os, sys
        os.environ["HF_HOME"] = {str(tmp_path / "hf_home")!r}  # an empty cache
        from sara.config import ConfigError
        from sara.envs.tasks import make_task
        task = make_task("sara/GSM8K-v0", hf_dataset={str(data)!r}, hf_split="train", hf_eval_split="test")
        assert len(task.prompts) == 30 and len(task.eval_prompts) == 9, (len(task.prompts), len(task.eval_prompts))
        assert task.prompts[2].answer == {{"answer": "6"}}
        try:
            make_task("sara/GSM8K-v0", hf_dataset="openai/gsm8k", hf_config="main")
        except ConfigError as exc:
            assert "offline cache" in str(exc), exc
        else:
            sys.exit("an uncached dataset loaded")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
