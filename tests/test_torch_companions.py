"""The vLLM extra's torchvision / torchaudio / torchcodec next to the CPU torch: detected where the HF / vLLM paths
start, with the one command that fixes it (tested on a fake module state; nothing is uninstalled)."""

from __future__ import annotations

import pytest

from sara import hub
from sara.cli import main


def _fake(installed: dict[str, Exception | None]):
    """find_spec / import_module fakes: ``installed[name]`` is None (imports fine) or the exception its import raises."""

    def find_spec(name):
        return object() if name in installed else None

    def import_module(name):
        if installed[name] is not None:
            raise installed[name]
        return object()

    return {"find_spec": find_spec, "import_module": import_module}


NMS = RuntimeError("operator torchvision::nms does not exist\nmore details")


def test_broken_companions_are_named_and_healthy_or_absent_ones_are_not():
    assert hub.broken_torch_companions(**_fake({})) == {}
    assert hub.broken_torch_companions(**_fake({"torchvision": None, "torchaudio": None})) == {}
    broken = hub.broken_torch_companions(**_fake({"torchvision": NMS, "torchaudio": None,
                                                  "torchcodec": OSError("libtorchcodec_core7.so: cannot open")}))
    assert broken == {"torchvision": "RuntimeError: operator torchvision::nms does not exist",
                      "torchcodec": "OSError: libtorchcodec_core7.so: cannot open"}


def test_check_prints_the_one_command_that_fixes_it():
    hub.check_torch_companions(**_fake({"torchaudio": None}))  # healthy: nothing raised
    with pytest.raises(hub.TorchCompanionError) as err:
        hub.check_torch_companions(**_fake({"torchvision": NMS, "torchcodec": ImportError("x")}))
    msg = str(err.value)
    assert msg.endswith("Fix: pip uninstall -y torchvision torchcodec") and "\n" not in msg
    assert "torchvision::nms does not exist" in msg and "LlamaConfig" in msg


@pytest.fixture
def broken_torchvision(monkeypatch):
    real = hub.broken_torch_companions
    monkeypatch.setattr(hub, "_companions_ok", False)
    monkeypatch.setattr(hub, "broken_torch_companions",
                        lambda **kw: real(**(kw or _fake({"torchvision": NMS}))))


def test_model_prepare_and_hf_loading_stop_with_the_fix(broken_torchvision, capsys, tmp_path):
    assert main(["model", "prepare", "smollm2", "--cache-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sara: error: torchvision installed beside torch")
    assert err[0].endswith("Fix: pip uninstall -y torchvision")
    with pytest.raises(hub.TorchCompanionError):
        hub.load_hf_model(tmp_path)
    from sara.backends.vllm import VLLMBackend

    with pytest.raises(hub.TorchCompanionError):
        VLLMBackend(model=str(tmp_path))
