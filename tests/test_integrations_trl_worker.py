"""SaraRolloutWorker (TRL's rollout-worker protocol) on a scripted backend: samples, advantages, versions, metrics."""

from __future__ import annotations

import queue
import time
import zlib

import numpy as np
import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]')")
RolloutSample = pytest.importorskip("trl.experimental.async_grpo.async_rollout_worker").RolloutSample

from sara.algos import grpo_advantages  # noqa: E402
from sara.config import ConfigError  # noqa: E402
from sara.envs.task_env import TaskEnv  # noqa: E402
from sara.integrations.trl_async import SaraRolloutWorker, WeightsVersionError  # noqa: E402
from sara.testing import ScriptedBackend, StreamingScriptedBackend  # noqa: E402
from sara.testing.scripted import prompt_text  # noqa: E402

TASK = "sara/Arithmetic-v0:max_digits=1,ops=+,pool_size=60,eval_size=10"


class HalfRight(ScriptedBackend):
    """Right answer for about half of the seeds (a hash of prompt and seed): most groups are mixed."""

    def answer(self, request, seed):
        text = prompt_text(request)
        a, b = text.rstrip("=").split("+")
        right = zlib.crc32(f"{text}|{seed}".encode()) % 2 == 0
        return f"{int(a) + int(b) + (0 if right else 1)}\n"


class Broken(ScriptedBackend):
    def answer(self, request, seed):
        raise RuntimeError("engine died")


def drain(worker, n, timeout=60.0):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        try:
            out.append(worker.rollout_buffer.get(timeout=0.2))
        except queue.Empty:
            worker.check_health(stale_after_s=timeout)
            assert time.monotonic() < deadline, f"only {len(out)} samples after {timeout}s"
    return out


def drain_metrics(worker):
    out = []
    while True:
        try:
            out.append(worker.metrics_queue.get_nowait())
        except queue.Empty:
            return out


@pytest.fixture
def worker():
    env = TaskEnv(TASK, HalfRight(), scorer_mode="inline")
    w = SaraRolloutWorker(env, "sara_paper:tau_low=0.45,completion=as_is", k=8, target_groups=4, seed=3)
    yield w
    w.stop()
    env.close()


def test_a_predictive_sampler_reports_no_ds_estimate():
    env = TaskEnv(TASK, HalfRight(), scorer_mode="inline")
    with SaraRolloutWorker(env, "sara_paper:tau_low=0.45", k=8, sampler="predictive", target_groups=4, seed=3) as w:
        w.start()
        drain(w, 10)
    metrics = drain_metrics(w)
    env.close()
    assert metrics and all("sara/ds_rollouts_estimate" not in m and "sara/rollouts_saved_vs_ds" not in m
                           for m in metrics)  # its draws overstate P(mixed): the estimate would undercount DS
    assert all("sara/p_mixed_estimate" in m for m in metrics)


def test_samples_are_trl_rollout_samples_with_grpo_advantages_by_group(worker):
    worker.update_model_version(0)
    worker.start()
    samples = drain(worker, 40)
    worker.stop()
    assert all(isinstance(s, RolloutSample) for s in samples)
    by_group: dict[int, list] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
        n_prompt = int((s.completion_mask == 0).sum())
        assert s.completion_mask[:n_prompt].sum() == 0 and s.completion_mask[n_prompt:].all()
        assert len(s.input_ids) == len(s.completion_mask) == len(s.old_log_probs)
        assert np.all(s.old_log_probs[:n_prompt] == 0) and np.allclose(s.old_log_probs[n_prompt:], -0.5)
        text = "".join(chr(t) for t in s.input_ids[n_prompt:])  # ScriptedBackend: code points as token ids
        assert text == s.completion[0]["content"]
        assert s.model_version == 0
    complete = {g: ss for g, ss in by_group.items() if len(ss) == worker.pushed_groups[g]}
    sizes = {len(ss) for ss in complete.values()}
    assert len(sizes) > 1, f"as_is keeps SARA's variable group sizes, got only {sizes}"
    for ss in complete.values():
        rewards = torch.tensor([s.metrics["reward"] for s in ss], dtype=torch.float64)
        expected = grpo_advantages(rewards, torch.zeros(len(ss), dtype=torch.long))
        assert np.allclose([s.advantage for s in ss], expected.numpy())
        assert 0 < rewards.sum() < len(ss)  # SARA commits mixed groups only
    assert len(set(worker.pushed_groups)) == len(worker.pushed_groups)  # ids are unique across steps


def test_metrics_queue_reports_allocation_in_trl_shapes(worker):
    worker.start()
    drain(worker, 10)
    worker.stop()
    metrics = drain_metrics(worker)
    assert len(metrics) >= 1
    m = metrics[0]
    eff, committed = m["sara/effective_fraction"]
    assert committed == 4 and eff == 4  # SARA commits mixed (effective) groups only
    assert m["sara/rollouts_total"] >= m["sara/abandoned_rollouts_total"] + 2 * committed  # mixed: >= 2 each
    assert m["sara/group_size_min"] <= m["sara/group_size_mean"] <= m["sara/group_size_max"] <= 8
    assert m["sara/cum_rollouts"] == m["sara/rollouts_total"]
    assert np.isfinite(m["sara/ds_rollouts_estimate"])
    assert m["sara/rollouts_saved_vs_ds"] == pytest.approx(m["sara/ds_rollouts_estimate"] - m["sara/cum_rollouts"])
    from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

    for key in m:  # every value reduces the way TRL's log() reduces a window
        assert np.isfinite(_reduce_metric(key, [m[key] for m in metrics])) or key == "sara/ds_rollouts_estimate"


def test_weight_transfer_loads_the_backend_and_versions_are_checked(worker):
    transfer = worker.weight_transfer()
    backend = worker.backend
    # TRL's cold sync before start: pause -> send -> resume -> the trainer announces version 1
    transfer.init_weight_transfer()
    transfer.pause()
    transfer.send_weights(iter([("w", torch.ones(2))]))
    transfer.resume()
    assert backend.version == 1
    worker.update_model_version(1)
    worker.start()
    first = drain(worker, 5)
    assert {s.model_version for s in first} == {1}
    transfer.pause()  # waits for the round in flight; no round starts while held
    n_calls = len(backend.calls)
    transfer.send_weights(iter([("w", torch.zeros(2))]))
    time.sleep(0.3)
    assert len(backend.calls) == n_calls
    transfer.resume()
    worker.update_model_version(2)
    assert backend.version == 2
    later = drain(worker, 200)
    assert later[-1].model_version == 2
    versions = [s.model_version for s in later]
    assert versions == sorted(versions)  # a step's samples carry the oldest version of any of its rounds
    with pytest.raises(WeightsVersionError, match="announced weights version 3 but the backend holds version 2"):
        worker.update_model_version(3)  # weights synced elsewhere: refused, like the Ray pool's version check


def test_resume_announces_a_version_before_start(worker):
    worker.update_model_version(7)  # TRL announces the checkpoint's version, then cold-syncs
    transfer = worker.weight_transfer()
    transfer.pause()
    transfer.send_weights(iter([]))
    transfer.resume()
    worker.update_model_version(8)
    assert worker.backend.version == 8


def test_failures_surface_through_check_health():
    env = TaskEnv(TASK, Broken(), scorer_mode="inline")
    w = SaraRolloutWorker(env, "ds", k=4, target_groups=2)
    w.start()
    deadline = time.monotonic() + 30
    with pytest.raises(RuntimeError, match="SaraRolloutWorker failed") as info:
        while time.monotonic() < deadline:
            w.check_health(stale_after_s=60)
            time.sleep(0.05)
    assert "engine died" in repr(info.value.__cause__)
    w.stop()


def test_token_level_advantages_and_bad_specs_are_refused():
    env = TaskEnv(TASK, HalfRight(), scorer_mode="inline")
    with pytest.raises(ConfigError, match="token-level"):
        SaraRolloutWorker(env, "sara", advantage="reinforce_pp")
    with pytest.raises(ConfigError, match="tau_low"):
        SaraRolloutWorker(env, "sara_paper:tau_low=1.5")
    w = SaraRolloutWorker(env, "ds", k=4, advantage="rloo")
    assert w.allocator.k == 4


@pytest.mark.parametrize("spec", ["uniform", "ds", "sara_paper:prior=history,decay=0.95,tau_low=0.2"])
def test_any_registered_allocator_and_sampler(spec):
    env = TaskEnv(TASK, HalfRight(), scorer_mode="inline")
    w = SaraRolloutWorker(env, spec, k=4, target_groups=3, sampler="predictive:decay=0.95")
    w.start()
    samples = drain(w, 12)
    w.stop()
    assert len({s.group_id for s in samples}) >= 3
    if spec == "uniform":  # uniform keeps saturated groups: exactly-zero GRPO advantage there
        assert all(worker_size == 4 for worker_size in w.pushed_groups.values())


class StreamingHalfRight(StreamingScriptedBackend):
    answer = HalfRight.answer


def test_the_worker_streams_with_carry_over_and_tags_each_group_with_its_oldest_weights():
    """Streaming driver inside the worker: samples flow, open prompts and running rollouts are carried between steps
    across a weight update (carried groups are tagged with the older version), and ``stop`` aborts what is left on the
    engine."""
    backend = StreamingHalfRight(slots=16)
    env = TaskEnv(TASK, backend, scorer_mode="inline")
    w = SaraRolloutWorker(env, "sara", k=4, target_groups=3, seed=1,
                          driver={"barrier": False, "carry_lag": 1})
    w.start()
    try:
        first = drain(w, 12)
        transfer = w.weight_transfer()
        transfer.pause()
        transfer.send_weights(iter([]))
        transfer.resume()
        w.update_model_version(1)
        later = drain(w, 60)
    finally:
        w.stop()
    assert {s.model_version for s in first} == {0}
    assert {s.model_version for s in later} >= {1} and min(s.model_version for s in later) == 0  # carried groups
    metrics = drain_metrics(w)
    assert any(m["sara/rollouts_total"] > 0 for m in metrics)
    assert backend.inflight() == 0 and w._carry is None  # nothing left running after stop
    env.close()


def test_streaming_needs_a_streaming_environment():
    with pytest.raises(ConfigError, match="field 'driver'.*cannot stream"):
        SaraRolloutWorker(TaskEnv(TASK, HalfRight(), scorer_mode="inline"), "sara", driver={"barrier": False})


def test_evaluate_scores_held_out_prompts_between_engine_calls(worker):
    import threading

    eval_env = TaskEnv(TASK, worker.backend, split="eval", scorer_mode="inline")
    first = worker.evaluate(eval_env, num_prompts=10, samples=4, seed=1)
    again = worker.evaluate(eval_env, num_prompts=10, samples=4, seed=1)
    assert again["eval/acc_sample"] == first["eval/acc_sample"]  # fixed seeds: the same rollouts
    assert 0.2 < first["eval/acc_sample"] < 0.8  # HalfRight: about half of the held-out rollouts right
    assert first["eval/weights_version"] == 0.0
    # while the trainer holds the weights (a sync in progress) an evaluation waits for it
    transfer = worker.weight_transfer()
    transfer.pause()
    done = threading.Event()
    threading.Thread(target=lambda: (worker.evaluate(eval_env, num_prompts=10, samples=4), done.set()),
                     daemon=True).start()
    assert not done.wait(0.5)
    transfer.resume()
    assert done.wait(30)


def test_the_worker_as_a_context_manager_stops_on_leaving_the_block():
    env = TaskEnv(TASK, HalfRight(), scorer_mode="inline")
    with pytest.raises(KeyError, match="left early"):
        with SaraRolloutWorker(env, "sara", k=8, target_groups=4, seed=3) as w:
            w.start()  # what TRL's trainer does when training begins
            drain(w, 8)
            raise KeyError("left early")
    assert w._thread is None and w._stop.is_set()
    with pytest.raises(RuntimeError, match="not running"):
        w.check_health(stale_after_s=60)
    env.close()
