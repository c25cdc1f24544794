"""Weight syncs cut into generation between decode steps (``sara.integrations.trl_sync``), on a tiny random Llama
whose decode loop the tests observe: a sync asked for mid-call is applied at the next step boundary, the steps after
it run on the new weights, rows prefilled after it carry the new version, and every rollout is still delivered once.
"""

from __future__ import annotations

import threading
import time
import zlib

import pytest

torch = pytest.importorskip("torch", reason="the HF backend needs torch")
pytest.importorskip("transformers", reason="the HF backend needs transformers")

from sara.backends.hf import HFBackend  # noqa: E402
from sara.envs.base import GenerationRequest, SamplingConfig, SteppedEngine  # noqa: E402
from sara.integrations.trl_sync import WeightsGate  # noqa: E402

PROMPTS = ["1+1=", "The quick brown fox jumps over the lazy", "Name a color please, any color at all"]
SAMPLING = SamplingConfig(max_new_tokens=6)


class Observed(HFBackend):
    """An HF backend that logs every forward (its weights version), every engine call and every boundary, and parks
    its generating thread at boundary ``park_at`` until ``ready()`` (a holder asked for the gate)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, prefix_cache_tokens=0, shared_prefix_tokens=0, **kwargs)
        self.log: list[tuple] = []
        self.boundaries = 0
        self.park_at: int | None = None
        self.ready = lambda: True
        self.parked = threading.Event()

    def _forward(self, ids, mask, pos, cache):
        self.log.append(("fwd", self.version, int(ids.shape[1])))
        return super()._forward(ids, mask, pos, cache)

    def _between_steps(self):
        self.boundaries += 1
        if self.boundaries == self.park_at:
            self.parked.set()
            while not self.ready():
                time.sleep(0.001)
        super()._between_steps()

    def generate(self, requests, sampling):
        self.log.append(("call",))
        out = super().generate(requests, sampling)
        self.log.append(("end", [c.policy_version for cs in out for c in cs]))
        return out

    def poll(self, timeout=None):
        self.log.append(("call",))
        out = super().poll(timeout)
        self.log.append(("end", [c.policy_version for _, c in out]))
        return out


@pytest.fixture
def backend(tiny_model_dir):
    b = Observed(str(tiny_model_dir), dtype="float32", max_batch_size=2)
    yield b
    b.close()


def _perturbed(b: HFBackend) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in b.model.state_dict().items()}


def _cut_in(b: Observed, work, park_at: int) -> tuple[list, int, int]:
    """Run ``work`` in a generating thread under a gate; at boundary ``park_at`` load new weights (version 1) through
    ``gate.hold()``. Returns ``work``'s result, the log length when the hold returned and when it was released."""
    gate = WeightsGate(lambda: False, RuntimeError)
    b.between_steps = gate.between_steps
    b.park_at, b.ready, b.boundaries = park_at, lambda: gate.waiting > 0, 0
    result: list = []
    thread = threading.Thread(target=lambda: result.append(work(gate)))
    gate.generator = thread
    thread.start()
    assert b.parked.wait(60)
    gate.hold()
    held_at = len(b.log)
    assert thread.is_alive()  # the engine call in flight is not over: the hold did not wait for it
    b.update_weights(_perturbed(b), 1)
    released_at = len(b.log)
    gate.release()
    thread.join(60)
    assert gate.handovers == 1 and result
    return result[0], held_at, released_at


def _versions(log: list, start: int, stop: int | None = None) -> set[int]:
    return {e[1] for e in log[start:stop] if e[0] == "fwd"}


def test_the_hf_backend_is_a_stepped_engine(backend):
    assert isinstance(backend, SteppedEngine) and backend.between_steps is None


def test_a_sync_cuts_into_a_round_between_decode_steps(backend):
    requests = [GenerationRequest(p, (11, 12)) for p in PROMPTS]  # 3 chunks of 2 rows (max_batch_size=2)
    before = backend.generate(requests, SAMPLING)
    backend.log.clear()

    def work(gate):
        with gate.generating():
            return backend.generate(requests, SAMPLING)

    out, held_at, released_at = _cut_in(backend, work, park_at=3)  # boundaries: chunk 1, its decode forwards 1, 2
    log = backend.log
    assert released_at == held_at  # nothing generated while the weights were held
    assert _versions(log, 0, held_at) == {0} and _versions(log, held_at) == {1}
    assert [e[0] for e in log[held_at:]].count("fwd") > 0 and log[-1][0] == "end"  # the call went on after the sync
    # chunk 1 (prompt 0) started on version 0: its tokens drawn from version-0 logits are version 0's tokens
    old = sum(1 for e in log[:held_at] if e[0] == "fwd")
    assert [c.policy_version for c in out[0]] == [0, 0]
    assert all(c.token_ids[:old] == ref.token_ids[:old] for c, ref in zip(out[0], before[0]))
    # chunks prefilled after the sync are version 1's completions, token for token
    assert [c.policy_version for cs in out[1:] for c in cs] == [1] * 4
    again = backend.generate(requests[1:], SAMPLING)
    assert [[c.token_ids for c in cs] for cs in out[1:]] == [[c.token_ids for c in cs] for cs in again]
    assert [len(cs) for cs in out] == [2, 2, 2]  # every row delivered once


def test_a_sync_cuts_into_a_streaming_poll_between_decode_steps(backend):
    items = [(t, GenerationRequest(p, (20 + t,))) for t, p in enumerate(PROMPTS * 2)]  # 6 rows through 2 slots
    backend.submit(items, SAMPLING)

    def work(gate):
        got = []
        while backend.inflight():
            with gate.generating():
                got += backend.poll()
        return got

    got, held_at, released_at = _cut_in(backend, work, park_at=3)
    assert released_at == held_at
    assert _versions(backend.log, 0, held_at) == {0} and _versions(backend.log, held_at) == {1}
    by_tag = dict(got)
    assert sorted(t for t, _ in got) == list(range(6))  # each tag once
    assert [by_tag[t].policy_version for t in range(6)] == [0, 0, 1, 1, 1, 1]  # admitted after the sync: version 1
    again = backend.generate([r for _, r in items[2:]], SAMPLING)
    assert [by_tag[t].token_ids for t in range(2, 6)] == [cs[0].token_ids for cs in again]


def test_a_holder_waits_for_no_engine_call_and_the_generator_starts_none_while_one_waits():
    gate = WeightsGate(lambda: False, RuntimeError)
    gate.generator = threading.current_thread()
    calls = []

    def holder():
        gate.hold()
        calls.append("held")
        gate.release()

    with gate.generating():
        t = threading.Thread(target=holder)
        t.start()
        while not gate.waiting:
            time.sleep(0.001)
        gate.between_steps()  # the step boundary hands over and takes the gate back after the holder
        calls.append("step after the handover")
    t.join(10)
    assert calls == ["held", "step after the handover"]


def test_stopping_interrupts_a_generator_waiting_at_a_boundary():
    stop = threading.Event()
    gate = WeightsGate(stop.is_set, InterruptedError)
    gate.generator = threading.current_thread()
    taken = threading.Event()
    with pytest.raises(InterruptedError), gate.generating():
        threading.Thread(target=lambda: (gate.hold(), taken.set()), daemon=True).start()
        while not gate.waiting:
            time.sleep(0.001)
        stop.set()
        gate.between_steps()  # hands over, then cannot take the gate back: the holder keeps it
    assert taken.wait(10)
    gate.release()  # the holder's: the interrupted generator did not release what it no longer held


# ------------------------------------------------------------------------------------------------ the TRL worker
def _hash_task():
    from sara.envs.tasks import Task
    from sara.types import Prompt

    prompts = [Prompt(id=f"p{i}", prompt=f"{i}+{i % 7}=", answer={}) for i in range(40)]
    return Task(id="tests/Hash-v0", prompts=prompts, verifier=lambda completion: float(zlib.crc32(
        completion.encode()) % 2), max_new_tokens=5)


def test_the_worker_applies_a_trl_sync_inside_the_round_in_flight(backend):
    """TRL's pause -> send_weights -> resume while the worker's round is mid-call: the pause returns at the next
    decode step, calls started after it generate on version 1, and each step still accounts for every rollout."""
    pytest.importorskip("trl.experimental.async_grpo", reason="TRL is not installed (pip install -e '.[trl]')")
    from sara.envs.task_env import TaskEnv
    from sara.integrations.trl_async import SaraRolloutWorker

    env = TaskEnv(_hash_task(), backend, scorer_mode="inline")
    worker = SaraRolloutWorker(env, "sara_paper:tau_low=0.45,completion=as_is", k=4, target_groups=2, seed=5)
    transfer = worker.weight_transfer()
    backend.park_at, backend.ready = 5, lambda: worker.gate.waiting > 0
    worker.start()
    try:
        assert backend.parked.wait(60)
        transfer.pause()
        held_at = len(backend.log)
        transfer.send_weights(iter(_perturbed(backend).items()))
        assert len(backend.log) == held_at  # the worker waits while the trainer holds the weights
        transfer.resume()
        worker.update_model_version(1)
        deadline = time.monotonic() + 120
        while worker.steps < 3:
            worker.check_health(stale_after_s=120)
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        worker.stop()
    assert backend.between_steps is None  # stop uninstalls the worker's hook
    log = backend.log
    last_call = max(i for i, e in enumerate(log[:held_at]) if e[0] == "call")
    assert all(e[0] != "end" for e in log[last_call:held_at])  # the pause returned inside an engine call
    assert _versions(log, 0, held_at) == {0} and _versions(log, held_at) == {1}
    first_end = next(i for i, e in enumerate(log) if i > held_at and e[0] == "end")
    in_flight = log[first_end][1]  # the round the sync cut into: its first chunk (2 rows) began on version 0
    assert in_flight[:2] == [0, 0] and set(in_flight[2:]) <= {1}
    assert all(v == 1 for e in log[first_end + 1:] if e[0] == "end" for v in e[1])  # later calls: version 1 only
    # accounting: each step's rollouts are its committed, abandoned and discarded ones; each pushed group's rollouts
    # reach TRL's queue once
    metrics = []
    while not worker.metrics_queue.empty():
        metrics.append(worker.metrics_queue.get())
    for m in metrics[:worker.steps]:
        committed = m["sara/committed_groups_total"] * m["sara/group_size_mean"]
        assert m["sara/rollouts_total"] == committed + m["sara/abandoned_rollouts_total"] \
            + m["sara/discarded_rollouts_total"]
    samples = []
    while not worker.rollout_buffer.empty():
        samples.append(worker.rollout_buffer.get())
    published = int(sum(m["sara/committed_groups_total"] for m in metrics[:worker.steps]))
    counts: dict[int, int] = {}
    for s in samples:
        counts[s.group_id] = counts.get(s.group_id, 0) + 1
    assert {g: counts.get(g, 0) for g in range(published)} == {g: worker.pushed_groups[g] for g in range(published)}
    assert {s.model_version for s in samples} <= {0, 1} and any(s.model_version == 1 for s in samples)
    env.close()
