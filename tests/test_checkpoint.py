"""Checkpoints you can trust: an explicit encoding (no pickle), a checksum marker per checkpoint, resume falls back to
the newest valid one, a malicious pickle is refused without running, a failed write keeps the previous checkpoint,
SIGINT / SIGTERM are deferred to the end of the step."""

from __future__ import annotations

import errno
import math
import os
import pickle
import random
import signal
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sara.train import checkpoint as ck  # noqa: E402
from sara.train.codec import decode, encode  # noqa: E402
from sara.train.guards import StopSignals  # noqa: E402


def _state() -> dict:
    """What a trainer checkpoint holds: tensors, AdamW's int keys and tuples, numpy arrays of several dtypes,
    numpy scalars, RNG states, non-finite floats, nested lists."""
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    return {
        "learner": {"policy": net.state_dict(), "optimizer": opt.state_dict(), "optimizer_steps": 1},
        "allocator": {"config": {"probe": (2, 1), "tau_low": 0.45}, "counters": {"rollouts": 12},
                      "prior": {"succ": np.array([1.5, 0.0, np.nan]), "last_step": np.arange(3, dtype=np.int64),
                                "taken": np.array([True, False]), "hist": [np.zeros((2, 0), np.int32)]},
                      "step": np.int64(7), "alpha": np.float32(0.25)},
        "totals": {"rollouts": 48.0, "tokens": math.inf, "p": -math.inf, "q": math.nan},
        "outcomes": {"k": 4, "rows": [[4, 0, 0, 3.0], [2, 1, 1, 1.0]]},
        "rng": ck.rng_state(), "raw": b"\x00\xff", "$weird": {1: "int key", (2, 3): "tuple key"},
    }


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (np.ndarray, np.generic)):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def test_codec_round_trips_exactly_and_is_plain_json_plus_tensors():
    import json

    state = _state()
    tree, tensors = encode(state)
    text = json.dumps(tree, allow_nan=False)  # strict JSON: no NaN literals, no pickled objects
    assert all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert _same(decode(json.loads(text), tensors), state)
    with pytest.raises(TypeError, match=r"state\.bad: a builtins\.object cannot be stored"):
        encode({"bad": object()})
    with pytest.raises(TypeError, match="dtype object"):
        encode({"a": np.array([None])})
    with pytest.raises(ValueError, match="unknown marker"):
        decode({"$evil": 1}, {})


def test_save_load_round_trip_restores_rng_streams(tmp_path):
    state = _state()
    path = ck.save_checkpoint(state, ck.checkpoint_path(tmp_path, 3))
    assert path.name == "ckpt-000003.pt"
    assert ck.marker_path(path).read_text().split() == [__import__("hashlib").sha256(path.read_bytes()).hexdigest(),
                                                        path.name]
    # the payload is tensors + plain containers: the weights-only loader reads it
    assert isinstance(torch.load(path, weights_only=True)["state"], str)
    expected = (random.random(), np.random.random(), torch.rand(1).item())
    loaded = ck.load_checkpoint(path)
    assert _same(loaded, state)
    assert isinstance(loaded["learner"]["optimizer"]["param_groups"][0]["betas"], tuple)
    assert list(loaded["learner"]["optimizer"]["state"]) == [0, 1]  # int parameter ids stay ints
    ck.set_rng_state(loaded["rng"])
    assert (random.random(), np.random.random(), torch.rand(1).item()) == expected


def _write(tmp_path: Path, steps=(2, 4, 6)) -> list[Path]:
    return [ck.save_checkpoint({"step": s, "w": torch.full((2,), float(s))}, ck.checkpoint_path(tmp_path, s))
            for s in steps]


class _Payload:
    """Unpickling this creates a file: what a malicious checkpoint would do."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def _malicious(path: Path, target: Path, *, forge_marker: bool) -> None:
    import hashlib

    with open(path, "wb") as fh:
        pickle.dump({"state": _Payload(str(target))}, fh)
    if forge_marker:  # the attacker also rewrites the checksum: the weights-only loader must still refuse
        ck.marker_path(path).write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    # sanity: a plain pickle.load of this file would create the target
    assert not target.exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "tampered", "no_marker", "malicious", "malicious_forged",
                                    "torch_pickle_forged"])
def test_resume_falls_back_to_the_newest_valid_checkpoint(tmp_path, damage):
    a, b, c = _write(tmp_path)
    target = tmp_path / "pwned"
    if damage == "truncated":
        c.write_bytes(c.read_bytes()[: c.stat().st_size // 2])
    elif damage == "empty":
        c.write_bytes(b"")
    elif damage == "tampered":
        data = bytearray(c.read_bytes())
        data[len(data) // 2] ^= 1
        c.write_bytes(bytes(data))
    elif damage == "no_marker":
        ck.marker_path(c).unlink()
    elif damage in ("malicious", "malicious_forged"):
        _malicious(c, target, forge_marker=damage == "malicious_forged")
    else:  # a torch.save of an arbitrary object (pickled inside the zip), with a forged marker
        import hashlib

        torch.save({"format": "sara-checkpoint", "x": _Payload(str(target))}, c)
        ck.marker_path(c).write_text(f"{hashlib.sha256(c.read_bytes()).hexdigest()}  {c.name}\n")
    reason = {"truncated": "checksum mismatch", "empty": "empty file", "tampered": "checksum mismatch",
              "no_marker": "no completion marker", "malicious": "checksum mismatch",
              "malicious_forged": "refused by the weights-only loader",
              "torch_pickle_forged": "refused by the weights-only loader"}[damage]
    with pytest.raises(ck.CheckpointError, match=reason) as err:
        ck.load_checkpoint(c)
    assert str(c) in str(err.value)
    path, state, skipped = ck.resume_checkpoint(tmp_path)
    assert path == b and state["step"] == 4 and torch.equal(state["w"], torch.full((2,), 4.0))
    assert len(skipped) == 1 and str(c) in skipped[0] and reason in skipped[0]
    assert not target.exists(), "loading ran code from the checkpoint"


def test_resume_with_no_usable_checkpoint_is_an_error_naming_each(tmp_path):
    assert ck.resume_checkpoint(tmp_path / "none") == (None, None, [])
    a, b = _write(tmp_path, (1, 2))
    a.write_bytes(b"")
    ck.marker_path(b).unlink()
    with pytest.raises(ck.CheckpointError, match=r"no usable checkpoint.*ckpt-000002\.pt: no completion marker.*"
                                                 r"ckpt-000001\.pt: empty file"):
        ck.resume_checkpoint(tmp_path)
    assert ck.latest_checkpoint(tmp_path) == a  # markers make a checkpoint complete; load_checkpoint verifies


def test_prune_removes_markers_too(tmp_path):
    _write(tmp_path, (1, 2, 3))
    ck.prune_checkpoints(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003.pt", "ckpt-000003.pt.sha256"]


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_failed_write_leaves_previous_checkpoints_intact(tmp_path, monkeypatch):
    _write(tmp_path, (2, 4))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert len(before) == 4
    monkeypatch.setattr(ck, "atomic_write", _disk_full)
    with pytest.raises(OSError, match="No space left"):
        ck.save_checkpoint({"step": 6}, ck.checkpoint_path(tmp_path, 6))
    with pytest.raises(OSError):  # rewriting an existing step fails too: its old files stay
        ck.save_checkpoint({"step": 4}, ck.checkpoint_path(tmp_path, 4))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()
    # the checkpoint is written but the marker is not: the unverifiable checkpoint is removed
    real, calls = ck.atomic_write, []

    def marker_fails(path, write):
        calls.append(Path(path).name)
        if str(path).endswith(".sha256"):
            _disk_full()
        return real(path, write)

    monkeypatch.setattr(ck, "atomic_write", marker_fails)
    with pytest.raises(OSError):
        ck.save_checkpoint({"step": 6}, ck.checkpoint_path(tmp_path, 6))
    assert calls == ["ckpt-000006.pt", "ckpt-000006.pt.sha256"]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert ck.resume_checkpoint(tmp_path)[1]["step"] == 4


def test_stop_signals_defers_the_first_signal_and_not_the_second():
    # Start from Python's own handlers: an engine started by an earlier test (vLLM) may have replaced them.
    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        previous = signal.getsignal(signal.SIGTERM)
        # raise_signal sends to THIS thread, so the handler has run when it returns; os.kill(pid) may be delivered to
        # any thread of the process (earlier tests leave engine / Ray threads), and then the handler runs a bit later.
        with StopSignals() as stop:
            signal.raise_signal(signal.SIGTERM)
            assert stop.received == "SIGTERM"
            assert signal.getsignal(signal.SIGTERM) is previous  # a second one is not deferred
        with StopSignals() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.received == "SIGINT"
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])
