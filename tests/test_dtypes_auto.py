"""Dtypes chosen by the hardware: ``auto`` (the default of the HF policy's compute dtype and of the HF / vLLM
backends' dtype) resolves through ``sara.machine``'s probe, mocked both ways (a CPU with AVX512-BF16 / AMX, one
without, one whose oneDNN is capped below them, a CUDA device with and without bf16); every shipped config resolves
through ``auto``; forcing bfloat16 where it is not native warns once; ``sara train`` prints what it chose and a run's
summary records the machine."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from sara import machine  # noqa: E402
from sara.backends.hf import HFBackendConfig  # noqa: E402
from sara.backends.vllm import VLLMBackendConfig  # noqa: E402
from sara.policies.hf import HFPolicyConfig  # noqa: E402
from sara.train.config import load_config  # noqa: E402
from sara.train.dtypes import run_dtypes, run_machine  # noqa: E402

pytestmark = pytest.mark.isa  # results depend on the CPU's kernels: .ci/run runs these under AVX2 too

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))
NATIVE = ("Intel(R) Xeon(R) Platinum", frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}))
EMULATED = ("AMD EPYC 7B13 64-Core Processor", frozenset({"avx2", "avx512f"}))


@pytest.fixture
def cpu(monkeypatch):
    """``cpu(NATIVE)`` / ``cpu(EMULATED)``: the CPU the probe sees; warnings forgotten, no ISA cap in the env."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(machine, "_WARNED", set())

    def use(info):
        monkeypatch.setattr(machine, "_cpuinfo", lambda: info)
    return use


@pytest.mark.parametrize("info, want", [(NATIVE, "bfloat16"), (EMULATED, "float32")])
def test_auto_follows_the_cpu_probe(cpu, info, want):
    cpu(info)
    assert HFBackendConfig().dtype == "auto" and HFPolicyConfig().compute_dtype == "auto"  # the defaults
    assert HFBackendConfig().dtype_choice().name == want
    assert VLLMBackendConfig().dtype_choice("cpu").name == want
    learner = HFPolicyConfig().compute_choice()
    assert learner.name == want and ("autocast over float32 weights" in learner.reason) == (want == "bfloat16")
    assert ("natively" in learner.reason) == (want == "bfloat16")
    assert HFBackendConfig(dtype="float32").dtype_choice().name == "float32"  # an explicit dtype is kept


def test_onednn_isa_cap_below_bf16_means_float32(cpu, monkeypatch):
    cpu(NATIVE)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    choice = HFBackendConfig().dtype_choice()
    assert choice.name == "float32" and "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in choice.reason
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")  # a cap at or above AVX512_CORE_BF16 keeps it
    assert HFBackendConfig().dtype_choice().name == "bfloat16"


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_follows_the_cuda_probe(cpu, monkeypatch, bf16):
    cpu(NATIVE)  # the host CPU must not matter for a CUDA device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    want = "bfloat16" if bf16 else "float32"
    assert HFBackendConfig(device="cuda").dtype_choice().name == want
    assert HFPolicyConfig(device="cuda:0").compute_choice().name == want
    assert VLLMBackendConfig().dtype_choice().name == want  # the engine's device: cuda where torch sees one


def test_forcing_bf16_on_a_cpu_without_it_warns_once(cpu):
    cpu(EMULATED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = HFBackendConfig(dtype="bfloat16").dtype_choice()
        HFPolicyConfig(compute_dtype="bfloat16").compute_choice()
        machine.resolve_dtype("bfloat16", "cpu")
    assert first.name == "bfloat16" and first.reason.startswith("as asked; this CPU has no native bfloat16")
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1 and "slower than float32" in str(runtime[0].message)
    cpu(NATIVE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bfloat16 asked for where it is native: no warning
        machine.resolve_dtype("bfloat16", "cpu")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
@pytest.mark.parametrize("info, want", [(NATIVE, "bfloat16"), (EMULATED, "float32")])
def test_every_shipped_config_resolves_through_auto(cpu, path, info, want):
    cpu(info)
    cfg = load_config(path)
    for field in ("policy", "backend"):
        options = cfg.component(field)[1]
        assert options.get("compute_dtype", "auto") == "auto" and options.get("dtype", "auto") in ("auto", "float32")
    choices = run_dtypes(cfg)
    assert {what: c.name for what, c in choices.items()} == {"generation": want, "learner": want}
    assert cfg.component("policy")[1].get("dtype") == "float32"  # float32 master weights for AdamW stay


@pytest.mark.hf
@pytest.mark.parametrize("info, want", [(NATIVE, torch.bfloat16), (EMULATED, torch.float32)])
def test_built_policy_and_backend_compute_as_resolved(cpu, tiny_model_dir, info, want):
    from sara.backends.hf import HFBackend, make_hf_backend
    from sara.policies.hf import HFPolicy

    cpu(info)
    policy = HFPolicy(str(tiny_model_dir))
    assert next(policy.model.parameters()).dtype == torch.float32  # master weights
    assert policy.autocast_dtype == (torch.bfloat16 if want == torch.bfloat16 else None)
    copy = make_hf_backend(policy, {})  # the generating copy of the policy's weights
    loaded = HFBackend(str(tiny_model_dir))  # loaded by name
    for backend in (copy, loaded):
        assert next(backend.model.parameters()).dtype == want and backend.compute.name == str(want)[6:]
    shared = make_hf_backend(policy, {"share_policy": True})
    assert shared.compute.name == "float32" and "share_policy" in shared.compute.reason


def test_print_config_and_the_first_lines_say_what_was_chosen(cpu, tmp_path, capsys):
    from sara.cli import main

    cpu(EMULATED)
    path = CONFIGS[0]
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "# generation: float32 (this CPU has no native bfloat16" in out
    assert "# learner: float32 (this CPU has no native bfloat16" in out
    settings = ["task=sara/Arithmetic-v0:max_digits=2,pool_size=400,eval_size=40", "groups_per_step=2", "k=4",
                "steps=1", "eval.every=0", "eval.num_prompts=4", "eval.samples=1", "threads=1", "tensorboard=false",
                "policy_options={d_model: 32, n_layers: 1, n_heads: 2, warm_start: {steps: 5, batch_size: 8}}"]
    report = tmp_path / "summary.json"
    argv = ["train", "--quiet", "--out", str(tmp_path / "run"), "--json", str(report)]
    assert main([*argv, *[a for s in settings for a in ("--set", s)]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == ["generation: float32 (the tiny transformer computes in float32)",
                          "learner: float32 (the tiny transformer computes in float32)"]
    recorded = json.loads(report.read_text())["machine"]  # the run's summary records the machine
    assert recorded["cpu"] == EMULATED[0] and recorded["cpu_flags"] == ["avx2", "avx512f"]
    assert recorded["bf16_native"] is False and recorded["threads"] == 1 and recorded["torch"] == torch.__version__
    assert recorded["cores"] >= 1 and "no native bf16" in recorded["kind"]
    assert recorded["dtypes"]["generation"] == {"dtype": "float32",
                                                "reason": "the tiny transformer computes in float32"}


def test_run_machine_records_the_resolved_dtypes(cpu):
    cpu(NATIVE)
    cfg = load_config(CONFIGS[0])
    info = run_machine(cfg)
    assert info["bf16_native"] is True and "amx_bf16" in info["cpu_flags"]
    assert {k: v["dtype"] for k, v in info["dtypes"].items()} == {"generation": "bfloat16", "learner": "bfloat16"}
