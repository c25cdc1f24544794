"""Training with the streaming driver (``TrainConfig.driver = {"barrier": False}``): a step on the tiny backend counts
aborted rollouts and occupancy, uniform streams the same step as synchronous rounds, and a run whose environment
cannot stream is a ``ConfigError`` naming ``driver``. (Kill + resume of a streaming run: tests/test_train_resume.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from sara.backends import BACKENDS  # noqa: E402
from sara.config import ConfigError, validate_config  # noqa: E402
from sara.train import TrainConfig, Trainer  # noqa: E402


def _cfg(tmp_path, **overrides) -> TrainConfig:
    return TrainConfig(**{"task": "sara/Arithmetic-v0:max_digits=1,pool_size=60,eval_size=4", "k": 4,
                          "groups_per_step": 3, "steps": 2, "eval": {"num_prompts": 2, "samples": 1, "greedy": False},
                          "policy_options": {"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}},
                          "threads": 1, "progress": False, "tensorboard": False, "out_dir": str(tmp_path),
                          **overrides})


def test_a_streaming_step_trains_and_reports_aborts_and_occupancy(tmp_path):
    with Trainer(_cfg(tmp_path, driver={"barrier": False, "slots": 8, "fill_idle": True}, allocator="sara:probe=2",
                      backend="tiny:max_batch_size=32")) as trainer:
        m = trainer.train_step()
    assert trainer.step == 1 and trainer.version == 1 and m["alloc/committed_groups"] >= 3
    assert 0 < m["alloc/mean_inflight"] <= 8  # driver.slots caps what is in flight below the engine's 32
    assert m["alloc/aborted_rollouts"] >= 0 and m["alloc/rollouts"] > 0


def test_uniform_streams_the_same_step_as_sync_and_ds_streams_effective_groups(tmp_path):
    runs = {}
    for driver in ("sync", "stream"):
        with Trainer(_cfg(tmp_path / driver, driver=driver, allocator="uniform")) as trainer:
            m = trainer.train_step()
        runs[driver] = {k: m[k] for k in ("alloc/rollouts", "alloc/committed_groups", "alloc/tokens")}
    assert runs["stream"] == runs["sync"]  # the same prompts and seeds, all of them committed
    with Trainer(_cfg(tmp_path / "ds", driver="stream", allocator="ds")) as trainer:
        m = trainer.train_step()
    assert m["alloc/committed_groups"] >= trainer.config.groups_per_step
    assert m["alloc/effective_groups"] == m["alloc/committed_groups"]


def _plain_tiny(policy, options=None, **kw):
    from sara.backends.tiny import TinyBackend

    class Plain:  # generates, cannot stream
        def __init__(self) -> None:
            self.inner = TinyBackend(policy, options)

        def generate(self, requests, sampling):
            return self.inner.generate(requests, sampling)

        def update_weights(self, state_dict, version):
            self.inner.update_weights(state_dict, version)

        def close(self):
            self.inner.close()

    return Plain()


def test_driver_stream_needs_a_streaming_environment(tmp_path, monkeypatch):
    monkeypatch.setitem(BACKENDS._items, "plain_tiny_for_tests", _plain_tiny)  # registered for this test only
    with pytest.raises(ConfigError, match=r"field 'driver'.*cannot stream"):
        Trainer(_cfg(tmp_path, driver="stream", backend="plain_tiny_for_tests"))
    with pytest.raises(ConfigError, match=r"field 'driver'.*runs in rounds"):
        Trainer(_cfg(tmp_path, driver="stream", allocator="sara_tree:node_prefix=true"))
    with pytest.raises(ConfigError, match="driver"):
        validate_config(TrainConfig, {"driver": "async"}, what="train config")
    Trainer(_cfg(tmp_path, backend="plain_tiny_for_tests")).close()  # the synchronous driver is fine


def test_carry_over_hands_work_to_the_next_step_except_at_checkpoints(tmp_path):
    # carry_lag=1: step 1 hands open units on, step 2 trains on them (stale rows); step 2 writes a checkpoint, so it
    # carries nothing, and neither does the run's last step.
    cfg = _cfg(tmp_path, driver={"barrier": False, "carry_lag": 1}, allocator="sara", backend="tiny:max_batch_size=32",
               steps=4,
               checkpoint_every=2, groups_per_step=4,
               policy_options={"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 40}})
    with Trainer(cfg) as trainer:
        summary = trainer.train(log=False)
    from sara.metrics import read_jsonl

    rec = {int(r["step"]): r for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert summary.steps == 4
    assert rec[1]["alloc/carried_out_rollouts"] + rec[1]["alloc/carried_out_inflight"] > 0
    assert rec[2]["alloc/carried_in_rollouts"] == rec[1]["alloc/carried_out_rollouts"]
    assert rec[2]["algo/stale_fraction"] > 0
    for step in (2, 4):  # a checkpoint step and the last: nothing left for later
        assert rec[step]["alloc/carried_out_rollouts"] == rec[step]["alloc/carried_out_inflight"] == 0
    assert trainer.backend.inflight() == 0


def test_carry_lag_needs_the_streaming_driver(tmp_path):
    with pytest.raises(ConfigError, match="field 'driver': field 'carry_lag': a streaming option"):
        validate_config(TrainConfig, {"driver": {"carry_lag": 1}}, what="train config")
    validate_config(TrainConfig, {"driver": {"carry_lag": 1, "barrier": False}}, what="train config")
