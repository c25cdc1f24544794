"""Streaming through the Ray pools: tags round-trip, routing by free slots, abort, weight versions, an actor killed
mid-stream (every tag back exactly once, same completions as a clean run), work lost twice ends the run."""

from __future__ import annotations

import functools
import os
import re
import sys
import zlib

import pytest

from sara import SimulatedEnv
from sara.backends.ray import RayEnvPool, RayRolloutPool, WorkerFailedError, streams_natively
from sara.envs.base import Completion, GenerationRequest, SamplingConfig, StreamingBackend, StreamingEnv
from sara.testing import StreamingScriptedBackend
from sara.testing.scripted import prompt_text
from sara.types import RolloutRequest

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

# The helpers below run inside Ray workers, which cannot import this test module: ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SAMPLING = SamplingConfig(max_new_tokens=16)


class TickBackend:
    """A continuous-batching engine in miniature (a ``StreamingBackend``): the oldest ``slots`` queued completions
    each gain one token per decode tick; ``poll`` ticks until at least one is finished. A completion is a pure
    function of (prompt, seed, weights), as with ``generate``.

    Args:
        slots: Concurrent completions.
        latch: A ``Latch`` actor every ``poll`` waits on first (the test decides when the poll may run).
        poison: A seed whose presence in flight makes ``poll`` kill the process.
    """

    per_request_seeds = True

    def __init__(self, slots: int = 4, latch=None, poison: int | None = None) -> None:
        self.slots, self.latch, self.poison = slots, latch, poison
        self.bias = self.version = 0
        self.queue: dict[int, list] = {}  # tag -> [request, sampling, tokens generated]
        self.seen: list[int] = []

    def _length(self, req, sampling) -> int:
        return 1 + (req.seeds[0] * 7 + self.bias) % (req.max_new_tokens or sampling.max_new_tokens)

    def _completion(self, req, seed: int, n: int) -> Completion:
        return Completion(text=f"{req.prompt}|{seed}|{self.bias}", token_ids=tuple(range(n)), logprobs=(-1.0,) * n,
                          seed=seed, policy_version=self.version)

    def generate(self, requests, sampling):
        return [[self._completion(r, s, self._length(GenerationRequest(r.prompt, (s,), r.max_new_tokens), sampling))
                 for s in r.seeds] for r in requests]

    def submit(self, items, sampling):
        for tag, req in items:
            self.queue[tag] = [req, sampling, 0]
            self.seen.append(tag)

    def poll(self, timeout=None):
        if self.latch is not None:
            ray.get(self.latch.wait.remote())
        if self.poison is not None and any(st[0].seeds[0] == self.poison for st in self.queue.values()):
            os._exit(1)
        out = []
        while self.queue and not out:
            for tag in list(self.queue)[: self.slots]:
                st = self.queue[tag]
                st[2] += 1
                if st[2] >= self._length(st[0], st[1]):
                    out.append((tag, self._completion(st[0], st[0].seeds[0], st[2])))
                    del self.queue[tag]
        return out

    def abort(self, tags):
        return sum(self.queue.pop(t)[2] for t in tags if t in self.queue)

    def inflight(self):
        return len(self.queue)

    def update_weights(self, state, version):
        self.bias, self.version = int(state["bias"]), version

    def close(self):
        pass


class SeededBackend:
    """A batch-only ``GenerationBackend`` (no streaming members, no policy_version): the pool micro-batches it."""

    def __init__(self) -> None:
        self.bias = 0

    def generate(self, requests, sampling):
        return [[Completion(text=f"{r.prompt}|{s}|{self.bias}", token_ids=(s % 5,), logprobs=(-1.0,), seed=s)
                 for s in r.seeds] for r in requests]

    def update_weights(self, state, version):
        self.bias = int(state["bias"])

    def close(self):
        pass


@ray.remote(num_cpus=0)
class Latch:
    def __init__(self) -> None:
        import asyncio

        self.event = asyncio.Event()

    async def open(self) -> None:
        self.event.set()

    async def wait(self) -> None:
        await self.event.wait()


def _items(n: int, start: int = 0) -> list[tuple[int, GenerationRequest]]:
    return [(t, GenerationRequest(prompt=f"p{t % 5}", seeds=(1000 + 13 * t,))) for t in range(start, start + n)]


def _expected(items, backend=None):
    backend = backend or TickBackend()
    return {t: backend.generate([r], SAMPLING)[0][0] for t, r in items}


def _drain(pool, got=None) -> dict[int, Completion]:
    got = {} if got is None else got
    while pool.inflight():
        for tag, c in pool.poll():
            assert tag not in got, f"tag {tag} came back twice"
            got[tag] = c
    assert pool.poll(timeout=0) == []
    return got


def test_micro_batch_stream_runs_one_batch_call_per_poll_and_detects_native_streams():
    from sara.backends.ray import MicroBatchStream
    from sara.envs.task_env import TaskEnv

    other = SamplingConfig(max_new_tokens=4)
    stream = MicroBatchStream(SeededBackend(), slots=2)
    stream.submit(_items(3), SAMPLING)
    stream.submit(_items(2, start=3), other)
    assert stream.abort([4, 99]) == 0 and stream.inflight() == 4
    polls = [stream.poll() for _ in range(4)]
    assert [[t for t, _ in p] for p in polls] == [[0, 1], [2], [3], []]  # oldest first, one sampling per call
    assert polls[0][1][1] == SeededBackend().generate([_items(2)[1][1]], SAMPLING)[0][0]
    task = "sara/Arithmetic-v0:max_digits=1,pool_size=20,eval_size=0,seed=0"
    assert streams_natively(TickBackend()) and not streams_natively(SeededBackend())
    assert streams_natively(TaskEnv(task, MixedScripted(), scorer_mode="inline"))
    assert not streams_natively(TaskEnv(task, SeededBackend(), scorer_mode="inline"))  # opts out: streams False


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
             _temp_dir=str(tmp_path_factory.mktemp("ray")), configure_logging=False)
    yield
    ray.shutdown()


def test_tags_round_trip_through_two_actors_routed_by_free_slots(ray_cluster):
    items = _items(20)
    with RayRolloutPool(functools.partial(TickBackend, 4), num_workers=2) as pool:
        assert isinstance(pool, StreamingBackend) and pool.native_stream and pool.slots == 8
        pool.submit(items[:6], SAMPLING)
        assert pool.inflight_per_worker() == [3, 3] and pool.inflight() == 6
        pool.submit(items[6:], SAMPLING)
        assert pool.inflight_per_worker() == [10, 10]
        with pytest.raises(ValueError, match="already in flight"):
            pool.submit(items[:1], SAMPLING)
        with pytest.raises(ValueError, match="one seed per item"):
            pool.submit([(99, GenerationRequest("p", (1, 2)))], SAMPLING)
        got = _drain(pool)
        assert got == _expected(items)
        assert {len(ray.get(a.attribute.remote("seen"))) for a in pool.actors} == {10}  # both actors worked
        m = pool.metrics()
        assert (m["ray/stream_submitted"], m["ray/stream_returned"], m["ray/stream_inflight"]) == (20, 20, 0)
        # weights reach every actor; completions carry the version that made them
        pool.update_weights({"bias": 3}, version=1)
        more = _items(6, start=100)
        pool.submit(more, SAMPLING)
        got = _drain(pool)
        ref = TickBackend()
        ref.update_weights({"bias": 3}, 1)
        assert got == _expected(more, ref) and {c.policy_version for c in got.values()} == {1}


def test_batch_only_backend_streams_by_micro_batches_and_gets_versions_stamped(ray_cluster):
    items = _items(11)
    with RayRolloutPool(SeededBackend, num_workers=2, micro_batch=3) as pool:
        assert not pool.native_stream and pool.slots == 6
        pool.submit(items, SAMPLING)
        got = _drain(pool)
        want = {t: SeededBackend().generate([r], SAMPLING)[0][0] for t, r in items}
        assert {t: c.text for t, c in got.items()} == {t: c.text for t, c in want.items()}
        assert {c.policy_version for c in got.values()} == {0}
        assert pool.abort([0, 1]) == 0  # already returned: ignored
        pool.submit(items[:4], SAMPLING)
        assert pool.abort([0, 2, 77]) == 0 and pool.inflight() == 2  # queued, nothing generated yet
        pool.update_weights({"bias": 2}, version=1)
        pool.submit(items[4:6], SAMPLING)
        got = _drain(pool)
        assert sorted(got) == [1, 3, 4, 5] and {c.policy_version for c in got.values()} == {1}


def test_abort_returns_generated_tokens_including_rollouts_finished_before_the_abort(ray_cluster):
    # one actor, 4 slots; lengths 1 + (7 * seed) % 16: tag 0 needs 4 tokens, tags 1-3 need 15, 13 and 11
    items = [(t, GenerationRequest(prompt="q", seeds=(s,))) for t, s in enumerate((5, 2, 4, 6))]
    steps = 4
    latch = Latch.remote()
    with RayRolloutPool(functools.partial(TickBackend, 4, latch), num_workers=1) as pool:
        pool.submit(items, SAMPLING)
        assert pool.poll(timeout=0) == []  # the actor's poll waits on the latch
        ray.get(latch.open.remote())
        # the abort reaches the actor after its poll ran 4 ticks and finished tag 0: that rollout is not returned
        # and its tokens count, like the 4 tokens tag 1 had generated
        victims = [0, 1]
        assert pool.abort(victims) == 2 * steps
        assert pool.inflight() == 2 and pool.abort(victims) == 0
        got = _drain(pool)
        assert sorted(got) == [2, 3]
        assert got == {t: c for t, c in _expected(items).items() if t in got}
        m = pool.metrics()
        assert (m["ray/stream_aborted"], m["ray/stream_aborted_tokens"]) == (2, 2 * steps)


def test_tag_order_hands_out_the_oldest_rollout_and_abort_drops_finished_ones_not_handed_out(ray_cluster):
    # lengths 1 + (7 * seed) % 16: tag 0 needs 15 tokens, tag 1 needs 4, tag 2 needs 11 (all decode at once)
    items = [(t, GenerationRequest(prompt="q", seeds=(s,))) for t, s in enumerate((2, 5, 6))]
    with RayRolloutPool(functools.partial(TickBackend, 4), num_workers=1, stream_order="tag") as pool:
        pool.submit(items, SAMPLING)
        assert [t for t, _ in pool.poll()] == [0]  # tags 1 and 2 finished first but wait behind the oldest
        assert pool.inflight() == 2 and pool.abort([1]) == 4  # finished, not handed out: dropped, tokens counted
        pool.submit(items[1:2], SAMPLING)  # the tag is free again
        assert [t for t, _ in pool.poll()] == [1] and [t for t, _ in pool.poll()] == [2]
        assert pool.poll() == [] and pool.inflight() == 0


@pytest.mark.parametrize("native", [True, False])
def test_actor_killed_mid_stream_every_tag_once_and_same_completions(ray_cluster, native):
    factory = functools.partial(TickBackend, 4) if native else SeededBackend
    items = _items(24)
    with RayRolloutPool(factory, num_workers=2, micro_batch=4) as pool:
        pool.submit(items, SAMPLING)
        clean = _drain(pool)
    with RayRolloutPool(factory, num_workers=2, micro_batch=4) as pool:
        pool.submit(items[:16], SAMPLING)
        got = dict(pool.poll())
        victim = pool.actors[1]
        ray.kill(victim, no_restart=True)
        pool.submit(items[16:], SAMPLING)  # some go to the dead actor too
        _drain(pool, got)
        assert got == clean and len(got) == 24
        assert pool.restarts == [0, 1] and pool.stream_counts["reissued"] >= 1
        assert pool.actors[1] is not victim
        # the re-issued rollouts went to the surviving actor, not to the fresh one
        if native:
            assert ray.get(pool.actors[1].attribute.remote("seen")) == []
        assert [w["version"] for w in pool.worker_info()] == [0, 0]
    want = _expected(items) if native else None
    if native:
        assert clean == want


def test_rollouts_lost_twice_end_the_run_with_a_clear_error(ray_cluster):
    poison = 1000 + 13 * 5  # tag 5's seed kills every actor that polls while holding it
    with RayRolloutPool(functools.partial(TickBackend, 4, None, poison), num_workers=2) as pool:
        pool.submit(_items(8), SAMPLING)
        with pytest.raises(WorkerFailedError) as info:
            _drain(pool)
        assert sum(pool.restarts) == 1  # the first death was survived (restart + re-issue), the second was not
    msg = str(info.value)
    assert "had already been re-issued once" in msg and "TickBackend" in msg, msg
    assert re.search(r"tags \[[0-9, ]*\b5\b", msg), msg


def test_env_pool_streams_a_simulator(ray_cluster):
    sim = functools.partial(SimulatedEnv, "u-shaped", size=50, seed=3)
    local = sim()
    reqs = [(t, RolloutRequest(unit_id=t, pool_index=t % 50, prompt=local.prompts[t % 50], seeds=(t,)))
            for t in range(30)]
    with RayEnvPool(sim, num_workers=2, micro_batch=5) as pool:
        assert isinstance(pool, StreamingEnv) and not pool.native_stream and pool.slots == 10
        pool.submit(reqs)
        got = _drain(pool)
    assert got == {t: local.rollout([r])[0][0] for t, r in reqs}


def test_tiny_backend_inside_actors_streams_the_same_completions(ray_cluster):
    pytest.importorskip("torch")
    from sara.backends.tiny import TinyBackend
    from sara.policies.tiny import TinyPolicy

    policy = TinyPolicy({"d_model": 16, "n_layers": 1, "n_heads": 2})
    local = TinyBackend(policy)
    sampling = SamplingConfig(max_new_tokens=6)
    items = [(t, GenerationRequest(prompt=f"{t}+{t % 3}=", seeds=(7 * t,))) for t in range(12)]
    with RayRolloutPool(functools.partial(TinyBackend, policy), num_workers=2, micro_batch=3) as pool:
        assert pool.native_stream == streams_natively(local)
        pool.submit(items[:8], sampling)
        got = dict(pool.poll())
        ray.kill(pool.actors[0], no_restart=True)
        pool.submit(items[8:], sampling)
        _drain(pool, got)
    assert sorted(got) == list(range(12))
    for t, r in items:
        want = local.generate([r], sampling)[0][0]
        c = got[t]
        assert (c.text, c.token_ids, c.seed, c.policy_version) == (want.text, want.token_ids, r.seeds[0], 0)
        assert c.logprobs == pytest.approx(want.logprobs, abs=1e-6)


class MixedScripted(StreamingScriptedBackend):
    """Arithmetic answers that are right for about a prompt-dependent share of seeds (mixed groups), streamed."""

    def answer(self, request, seed):
        a, op, b = re.findall(r"([0-9]+)([+-])([0-9]+)=", prompt_text(request))[-1]
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        right = zlib.crc32(f"{value}|{seed}".encode()) % 4 < 1 + value % 3
        return f"{value if right else value + 1}\n"


class KillDuringPoll:
    """A ``StreamingEnv`` wrapper that ``ray.kill``s worker 1 of ``pool`` at the first poll after ``after`` polls at
    which that worker holds rollouts."""

    def __init__(self, env, pool, after: int = 4) -> None:
        self.env, self.pool, self.after = env, pool, after
        self.prompts = env.prompts
        self.slots = env.slots
        self.polls = 0
        self.killed_holding = 0

    def rollout(self, requests):
        return self.env.rollout(requests)

    def submit(self, items):
        self.env.submit(items)

    def poll(self, timeout=None):
        self.polls += 1
        held = self.pool.inflight_per_worker()[1]
        if not self.killed_holding and self.polls > self.after and held:
            ray.kill(self.pool.actors[1], no_restart=True)
            self.killed_holding = held
        return self.env.poll(timeout)

    def abort(self, tags):
        return self.env.abort(tags)


def test_streaming_with_an_actor_killed_mid_stream_commits_the_clean_run_groups(ray_cluster):
    from sara import UniformSampler, collect, make_allocator
    from sara.envs.task_env import TaskEnv

    task = "sara/Arithmetic-v0:max_digits=2,pool_size=200,eval_size=0,seed=0"

    def run(kill: bool):
        # stream_order="tag": each poll hands out the oldest in-flight rollout, so the driver's view does not depend
        # on timing, and a re-issued rollout (same tag, same seed) takes the place of the lost one
        with RayRolloutPool(functools.partial(MixedScripted, 3), num_workers=2, stream_order="tag") as pool, \
                TaskEnv(task, pool, scorer_mode="inline") as env:
            driven = KillDuringPoll(env, pool) if kill else env
            alloc, sampler = make_allocator("sara", k=4), UniformSampler(len(env.prompts), seed=1)
            results = [collect(alloc, driven, sampler, target_groups=6, seed=5, driver={"barrier": False})
                       for _ in range(2)]
            return results, pool.restarts, pool.stream_counts["reissued"], getattr(driven, "killed_holding", 0)

    clean, restarts, reissued, _ = run(False)
    assert restarts == [0, 0] and reissued == 0
    killed, restarts, reissued, held = run(True)
    # killed while holding rollouts; those, and any routed to it before its death was seen, were re-issued
    assert restarts == [0, 1] and held >= 1 and reissued >= 1
    for a, b in zip(clean, killed, strict=True):
        assert len(a.groups) >= 6 and a.groups == b.groups  # the same committed groups, rollout for rollout
        assert (a.abandoned, a.discarded) == (b.abandoned, b.discarded)
        assert a.stats.rollouts == b.stats.rollouts and a.stats.aborted_rollouts == b.stats.aborted_rollouts
    assert any(0 < sum(r.reward for r in g.rollouts) < g.size for res in clean for g in res.groups)
