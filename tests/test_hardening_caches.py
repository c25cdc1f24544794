"""Caches are verified: a warm-start cache entry is used only when it hashes to the checksum written beside it and
holds the policy's finite tensors; a truncated, altered, checksum-less or non-finite entry is recomputed after one
line on stderr naming the file. A prepared model directory lists its files' checksums in its marker; a damaged file is
named and the model prepared again. And an error names the right place: a data file's bad byte is reported at its
own line."""

from __future__ import annotations

import io
import json

import pytest

torch = pytest.importorskip("torch")

from sara import hub  # noqa: E402
from sara.config import ConfigError  # noqa: E402
from sara.envs.tasks.data import load_records  # noqa: E402
from sara.policies.tiny import make_tiny_policy  # noqa: E402
from sara.storage import checksum_path, directory_checksums, verify_directory, write_verified  # noqa: E402
from sara.types import Prompt  # noqa: E402

OPTS = {"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 2, "batch_size": 4}}
PROMPTS = [Prompt(id=f"p{i}", prompt=f"{i}+1=", answer={"answer": i + 1}) for i in range(8)]


def _policy(capsys):
    capsys.readouterr()
    policy = make_tiny_policy(OPTS, prompts=PROMPTS, cache_key="t")
    return policy, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.fixture
def entry(tmp_path, monkeypatch, capsys):
    """A fresh cache with one warm-start entry; the first policy and the entry's path."""
    monkeypatch.setenv("SARA_CACHE_DIR", str(tmp_path))
    first, err = _policy(capsys)
    (path,) = (tmp_path / "tiny").glob("warm-*.pt")
    assert err == [] and checksum_path(path).is_file()
    return first, path


def test_an_intact_entry_is_used_without_a_word(entry, capsys, monkeypatch):
    from sara.policies import tiny

    first, _ = entry
    monkeypatch.setattr(tiny, "warm_start", lambda *a, **k: pytest.fail("recomputed an intact entry"))
    again, err = _policy(capsys)
    assert err == [] and _same(first, again)


def _rewrite(path, change) -> None:
    """Rewrite the entry's weights with ``change`` applied, keeping the old checksum file (as an edit would)."""
    state = torch.load(path, weights_only=True)
    change(state["model"])
    buf = io.BytesIO()
    torch.save(state, buf)
    path.write_bytes(buf.getvalue())


@pytest.mark.parametrize("damage", ["truncated", "altered", "no checksum", "non-finite", "wrong shapes"])
def test_a_bad_entry_is_recomputed_with_one_line_naming_it(damage, entry, capsys):
    first, path = entry
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        why = "does not match its checksum"
    elif damage == "altered":  # still a valid file of finite weights: only the checksum tells
        _rewrite(path, lambda w: w["head.weight"].add_(0.5))
        why = "does not match its checksum"
    elif damage == "no checksum":  # e.g. written by an earlier sara
        checksum_path(path).unlink()
        why = "has no checksum file"
    else:  # intact bytes, unusable content: the checksum is rewritten to match
        if damage == "non-finite":
            _rewrite(path, lambda w: w["head.weight"].fill_(float("nan")))
            why = "holds non-finite weights"
        else:
            _rewrite(path, lambda w: w.update({"head.weight": torch.zeros(3, 3)}))
            why = "does not hold this policy's weights"
        write_verified(path, path.read_bytes())
    again, err = _policy(capsys)
    assert len(err) == 1 and err[0].startswith(f"sara: note: cache entry {path} {why}") and "recomputing" in err[0]
    assert _same(first, again)  # recomputed: the same warm start from the same initial weights
    capsys.readouterr()
    _, err = _policy(capsys)
    assert err == []  # and cached again, intact


# ------------------------------------------------------------------------------------------- prepared models
def _prepared(root, files=True):
    target = hub.model_dir("smollm2", root)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"weights" * 100)
    meta = {"name": "smollm2"}
    if files:
        meta["files"] = directory_checksums(target)
    (target / hub.MARKER).write_text(json.dumps(meta))
    return target


def test_a_damaged_prepared_model_is_named_and_prepared_again(tmp_path, monkeypatch, capsys):
    target = _prepared(tmp_path)
    rebuilt = []
    monkeypatch.setattr(hub, "_prepare_locked", lambda name, src, t, **k: rebuilt.append(t))
    assert hub.prepare_model("smollm2", tmp_path) == target and rebuilt == []  # intact: no work
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated
    capsys.readouterr()
    hub.prepare_model("smollm2", tmp_path)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rebuilt == [target] and len(err) == 1, err
    assert err[0].startswith(f"sara: note: cache entry {weights} does not match its checksum")


def test_a_model_prepared_by_an_earlier_sara_gets_its_checksums_recorded(tmp_path, capsys):
    target = _prepared(tmp_path, files=False)
    capsys.readouterr()
    assert hub.is_prepared(target)
    assert "recorded the checksums" in capsys.readouterr().err
    meta = json.loads((target / hub.MARKER).read_text())
    assert set(meta["files"]) == {"config.json", "model.safetensors"} and verify_directory(target / hub.MARKER)


# ------------------------------------------------------------------------------------------- the right place
@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_bad_byte_is_reported_at_its_own_line(suffix, tmp_path):
    lines = [json.dumps({"question": f"q{i}", "answer": "#### 1"}).encode() for i in range(40)]
    lines[20] = b'{"question": "caf\xe9", "answer": "#### 1"}'  # past the first chunk a text reader decodes
    data = b"\n".join(lines) if suffix == ".jsonl" else b"[\n" + b",\n".join(lines) + b"\n]"
    path = tmp_path / f"d{suffix}"
    path.write_bytes(data)
    line = 21 if suffix == ".jsonl" else 22  # the .json list opens with "[" on a line of its own
    with pytest.raises(ConfigError, match=rf"d\{suffix}:{line}: byte 0xe9 at column 18: not UTF-8") as err:
        load_records(path, what="task 'gsm8k'")
    assert "\n" not in str(err.value)
