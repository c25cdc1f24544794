"""A checkpoint that verifies but does not describe this run is skipped before any of it is used, and resume falls back
to the older good one: wrong shapes, out-of-range indices, negative / fractional / absurd steps, missing and extra
keys, wrong-size RNG states, strings where numbers go, 100,000-deep JSON. Property: any mutation of a good state is
either refused (one line, fallback) or, when taken, loads to exactly that state (nothing coerced)."""

from __future__ import annotations

import copy
import math
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sara.train import TrainConfig, Trainer  # noqa: E402
from sara.train import checkpoint as ck  # noqa: E402
from sara.train.resume import check_resume  # noqa: E402

CFG = {"task": "sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8", "groups_per_step": 3, "k": 2, "steps": 2,
       "checkpoint_every": 1, "keep_checkpoints": 4, "eval": {"num_prompts": 4, "samples": 1, "greedy": False},
       "threads": 1, "progress": False, "tensorboard": False, "scorer": "inline",
       "allocator": "sara:group_by=auto",  # the richest allocator state: one grouped prior per feature of the pool
       "policy_options": {"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-step run (checkpoints 1 and 2), its step-2 state (with a banked group), and a fresh trainer of the
    same config to validate against."""
    root = tmp_path_factory.mktemp("ckpt")
    with Trainer(TrainConfig(**CFG, out_dir=str(root / "run"))) as t:
        t.train()
    good = ck.load_checkpoint(ck.checkpoint_path(root / "run" / "checkpoints", 2))
    if not good["bank"]["groups"]:  # a banked group, so the bank's checks have something to check
        r = {"prompt_id": "arith-000003", "pool_index": 3, "completion": "7", "reward": 1.0, "num_tokens": 1, "seed": 5,
             "token_ids": (4,), "logprobs": (-0.5,), "prompt_token_ids": (1, 2), "finish_reason": "stop",
             "policy_version": 2, "metadata": {}}
        good["bank"]["groups"] = [{"group_id": 0, "pool_index": 3, "decision": 1, "metadata": {},
                                   "rollouts": [r, {**r, "reward": 0.0, "seed": 6}]}]
    fresh = Trainer(TrainConfig(**CFG, out_dir=str(root / "fresh")))
    loader = Trainer(TrainConfig(**CFG, out_dir=str(root / "loader")))
    loader.backend.update_weights = lambda state, version: None  # loaded many times: the generator is not the point
    yield root / "run" / "checkpoints", good, fresh, loader
    fresh.close()
    loader.close()


def _resume(run, tmp_path, state) -> tuple:
    """Write ``state`` as checkpoint 2 next to the good checkpoint 1; what resume picks."""
    src, _, fresh, _ = run
    d = tmp_path / "checkpoints"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for name in ("ckpt-000001.pt", "ckpt-000001.pt.sha256"):
        shutil.copy(src / name, d / name)
    if state is not None:
        ck.save_checkpoint(state, ck.checkpoint_path(d, 2))
    return ck.resume_checkpoint(d, check=lambda p, s: check_resume(fresh, p, s))


def test_the_good_state_is_taken(run, tmp_path):
    path, state, skipped = _resume(run, tmp_path, run[1])
    assert path.name == "ckpt-000002.pt" and skipped == []


def _set(state, path, value):
    node = state
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return state


DELETE = object()
WEIGHT = "learner.policy"


@pytest.mark.parametrize(("where", "value", "needle"), [
    (("learner", "policy", "<first>"), torch.zeros(3, 3), "expected a torch.float32 tensor of shape"),
    (("learner", "policy", "<first>"), "<nan>", "holds nan or inf"),
    (("bank", "groups", 0, "pool_index"), 40, "out of range [0, 39]"),
    (("bank", "groups", 0, "pool_index"), -1, "out of range"),
    (("bank", "groups", 0, "rollouts", 0, "token_ids"), (-3,), "token ids"),
    (("counters", "step"), -2, "out of range"),
    (("counters", "step"), 10**12, "out of range"),
    (("counters", "step"), 2.7, "expected a whole number, got float 2.7"),
    (("counters", "version"), 3, "out of range [0, 2]"),
    (("outcomes",), DELETE, "expected the keys"),
    (("sampler", "pos"), DELETE, "missing key 'pos'"),
    (("sampler", "pos"), 10**9, "outside the pool of 40 prompts"),
    (("sampler", "pos"), -5, "out of range"),
    (("sampler", "epoch"), "1", "expected a whole number, got str"),
    (("rng", "torch"), torch.zeros(10, dtype=torch.uint8), "random-number generator"),
    (("rng", "python"), (3, tuple(range(10)), None), "random-number generator"),
    (("allocator", "bogus"), 1, "unexpected key 'bogus'"),
    (("allocator", "config", "audit"), 0.5, "differs from the configured allocator"),
    (("totals", "rollouts"), "12", "expected a number, got str"),
    (("totals", "rollouts"), math.inf, "not a finite non-negative number"),
    (("totals", "bogus"), 1.0, "totals"),
    (("learner", "optimizer", "param_groups", 0, "betas"), (0.5, 0.5), "differs from the config"),
    (("learner", "optimizer_steps"), -1, "out of range"),
    (("evals", 0, "eval/acc_sample"), "x", "expected a number"),
    (("counters", "step"), np.full(40, -1), "expected a whole number"),  # its repr spans lines: still one line
    (("learner", "optimizer", "state", 0, "step"), DELETE, "expected AdamW's keys"),
    (("learner", "optimizer", "state", 0, "step"), torch.tensor(-1.0), "whole non-negative step count"),
    (("learner", "optimizer", "state", 0, "exp_avg_sq"), "<negative>", "non-negative"),
    (("outcomes", "rows", 0), "<row 1>", "given twice"),
    (("outcomes", "rows", 0, 0), DELETE, "as every other row"),
    # group_by=auto: one grouped prior per candidate split of the pool
    (("allocator", "prior", "candidates", "none", "ghist", 0), np.arange(3), "expected a list of plain values"),
    (("allocator", "prior", "scores"), [0.0], "1 scores for 2 candidates"),
    (("allocator", "prior", "candidates", "op", "share"), [0.5], "1 group shares"),
    (("allocator", "prior", "candidates", "bogus"), {}, "unexpected key 'bogus'"),
])
def test_a_checkpoint_that_does_not_describe_this_run_is_skipped(run, tmp_path, where, value, needle):
    state = copy.deepcopy(run[1])
    where = tuple(next(iter(state["learner"]["policy"])) if k == "<first>" else k for k in where)
    if isinstance(value, str) and value == "<nan>":
        value = torch.full_like(state["learner"]["policy"][where[-1]], math.nan)
    if isinstance(value, str) and value == "<negative>":
        value = -torch.ones_like(state["learner"]["optimizer"]["state"][0]["exp_avg_sq"])
    if isinstance(value, str) and value == "<row 1>":  # a second row of the same counts: loading would drop one
        value = list(state["outcomes"]["rows"][1])
    path, got, skipped = _resume(run, tmp_path, _set(state, where, value))
    assert path.name == "ckpt-000001.pt" and got["counters"]["step"] == 1, (where, skipped)
    assert len(skipped) == 1 and "ckpt-000002.pt" in skipped[0] and needle in skipped[0], skipped
    assert "\n" not in skipped[0]


def test_json_nested_100000_deep_is_skipped(run, tmp_path):
    d = tmp_path / "checkpoints"
    _resume(run, tmp_path, None)
    path = ck.checkpoint_path(d, 2)
    torch.save({"format": ck.FORMAT, "version": ck.VERSION, "state": "[" * 100_000 + "]" * 100_000, "tensors": {}}, path)
    import hashlib

    ck.marker_path(path).write_text(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    picked, _, skipped = ck.resume_checkpoint(d, check=lambda p, s: check_resume(run[2], p, s))
    assert picked.name == "ckpt-000001.pt" and "nested too deeply" in skipped[0]


def test_a_file_without_marker_is_skipped_without_being_read(tmp_path, monkeypatch):
    big = ck.checkpoint_path(tmp_path, 7)
    with open(big, "wb") as fh:
        fh.truncate(64 * 2**20)  # sparse: 64 MiB that would take time and memory to read
    opened = []
    real_open = open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy)
    monkeypatch.setattr(type(big), "read_bytes", lambda self: pytest.fail("read the whole file"))
    with pytest.raises(ck.CheckpointError, match="no completion marker"):
        ck.load_checkpoint(big)
    assert str(big) not in opened


def test_pruning_counts_only_complete_checkpoints_up_to_the_current_one(tmp_path):
    for step in (1, 2, 3):
        ck.save_checkpoint({"s": step}, ck.checkpoint_path(tmp_path, step))
    ck.save_checkpoint({"s": 50}, ck.checkpoint_path(tmp_path, 50))  # another run's, or skipped on resume
    ck.checkpoint_path(tmp_path, 999_999).write_bytes(b"junk without a marker")
    ck.prune_checkpoints(tmp_path, 1, current=ck.checkpoint_path(tmp_path, 3))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "ckpt-000003.pt" in names and "ckpt-000001.pt" not in names and "ckpt-000002.pt" not in names
    assert "ckpt-000050.pt" in names and "ckpt-999999.pt" in names


# ------------------------------------------------------------------------------------------------ property
def _paths(node, prefix=()):
    """Every path into a state (containers and leaves), except into tensors' and weights' insides."""
    yield prefix
    if isinstance(node, dict) and prefix[:2] != ("learner", "policy"):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            yield from _paths(v, (*prefix, i))


HOSTILE = [-1, -5, 0, 1, 2, 10**9, 10**12, 2.7, -0.5, math.nan, math.inf, "1", "", None, True, [], {}, (), [[[[1]]]],
           {"x": 1}, np.arange(3), np.zeros(0), np.full(40, -1), torch.zeros(2), DELETE, "<same>", "<extra>"]


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b.to(a.dtype))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return type(a) is type(b) or {type(a), type(b)} <= {int, float, np.int64, np.float64} and a == b


@settings(max_examples=40, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_any_mutation_is_refused_or_taken_exactly(run, tmp_path, data):
    _, good, _, loader = run
    state = copy.deepcopy(good)
    paths = [p for p in _paths(state) if p and p[0] not in ("config",)]
    where = data.draw(st.sampled_from(paths))
    value = data.draw(st.sampled_from(HOSTILE), label="value")
    if isinstance(value, str) and value == "<same>":
        value = copy.deepcopy(_get(good, where))
    if isinstance(value, str) and value == "<extra>":
        if not isinstance(_get(state, where), dict):
            return
        where, value = (*where, "extra_key"), 1
    _set(state, where, value)
    try:
        path, got, skipped = _resume(run, tmp_path, state)
    except TypeError:  # the codec refuses to write it (e.g. a bare object): not a checkpoint this test can make
        return
    event("refused" if path.name == "ckpt-000001.pt" else "taken")
    if path.name == "ckpt-000001.pt":
        assert len(skipped) == 1 and "\n" not in skipped[0] and skipped[0].startswith("checkpoint "), skipped
        return
    assert skipped == []
    loader.load_state_dict(got)  # taken: it must load to exactly what it says
    after = loader.state_dict()
    for key in ("counters", "totals", "outcomes", "evals", "allocator", "sampler", "bank", "learner"):
        assert _same(got[key], after[key]), (where, value, key)


def _get(state, path):
    node = state
    for key in path:
        node = node[key]
    return node
