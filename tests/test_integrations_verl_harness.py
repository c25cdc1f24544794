"""The CPU harness of the verl integration tests (runs in the verl environment, ``bash .ci/verl``; skipped elsewhere).

What is verl's real code here: TransferQueue in-process (``tq.init``), verl's hydra config, ``PPOTrainerSync(config)``
(whose ``_build_replay_buffer`` loads ``SaraSampler`` through ``trainer.v1.sampler.custom_sampler``), its
``prepare_step`` / ``_add_prompts_to_generate`` / ``_submit_batch_to_rollout``, verl's dataset collation, the
agent-loop worker ``AgentLoopWorkerTQ`` (``generate_sequences``, ``_run_prompt`` with ``__rollout_n__``,
``_agent_loop_postprocess`` into TransferQueue) behind ``SaraWorkerMixin``, ``upsample_batch_to_divisible_size`` and
``_compute_advantage`` (GRPO). Scripted: the LLM call of a session (``_sara_session``: a reward drawn from the
session's seed), the Ray transport between manager and workers (the workers run on an asyncio loop thread), and a
``Clock`` that releases waiting sessions in a seeded order so runs are reproducible.

Class boundary (cannot run without GPUs / model servers): ``PPOTrainer.init()`` (tokenizer, worker groups, LLM
servers), ``AgentLoopWorker.__init__`` (tokenizer, LLM client), ``SaraAgentLoopManager.create`` (Ray actors of the
workers), ``_balance_batch`` / log-prob / actor updates (FSDP engines).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import random
import threading
import time
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import pytest

pytest.importorskip("verl.trainer.ppo.v1.replay_buffer", reason="needs verl 0.9.1 (bash .ci/verl)")
pytest.importorskip("transfer_queue", reason="needs transferqueue (bash .ci/verl)")

import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput  # noqa: E402

from sara.integrations.verl import SaraAgentLoopManager  # noqa: E402
from sara.integrations.verl_agent_loop import SEEDS, worker_class  # noqa: E402
from sara.seeding import uniform_from_seeds  # noqa: E402

TRAIN = "train"
RATES = (0.0, 1.0, 0.5, 0.25, 0.75, 1.0, 0.0, 0.5)  # pass rate by pool index % 8: saturated and mixed prompts
_STARTED = False


def start_tq() -> None:
    """``tq.init()`` once per process (it starts Ray: ~20 s). On a 2-core machine Ray sees 2 CPUs and TQ's 3
    one-CPU actors never all schedule, so Ray is told there are 8."""
    global _STARTED
    if _STARTED:
        return
    os.environ.setdefault("RAY_OVERRIDE_RESOURCES", '{"CPU": 8}')
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tq.init()
    atexit.register(tq.close)
    _STARTED = True


def overrides(*, groups: int = 4, n: int = 4, sampler_kwargs: dict[str, Any] | None = None,
              extra: tuple[str, ...] = ()) -> list[str]:
    """verl command-line overrides that plug the sampler and the manager in."""
    out = [
        "trainer.use_v1=true", "trainer.v1.trainer_mode=sync",
        "trainer.v1.sampler.custom_sampler.path=pkg://sara.integrations.verl",
        "trainer.v1.sampler.custom_sampler.name=SaraSampler",
        "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=sara.integrations.verl.SaraAgentLoopManager",
        f"data.train_batch_size={groups}", "data.gen_batch_size=1", f"actor_rollout_ref.rollout.n={n}",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
    ]
    for key, value in (sampler_kwargs or {}).items():
        out.append(f"+trainer.v1.sampler.sampler_kwargs.{key}={value}")
    return out + list(extra)


def compose(config_dir: str | None = None, config_name: str = "ppo_trainer", items: list[str] | None = None) -> Any:
    """verl's hydra config (``ppo_trainer.yaml``, or a recipe on top of it) with ``items`` applied."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = config_dir or os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base=None):
        return hydra_compose(config_name=config_name, overrides=items or [])


def prompt_rows(count: int) -> list[dict[str, Any]]:
    """Dataset rows as verl's RLHFDataset yields them (raw prompt, rule-based reward, ``index``)."""
    return [{"raw_prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "data_source": "sara/arith",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)}, "extra_info": {"index": i, "split": "train"},
             "index": i} for i in range(count)]


class Clock:
    """Releases waiting sessions: ``tick`` waits until the workers are quiescent (every launched session waiting or
    done, every finished prompt's status written), releases ``per_tick`` of the waiting ones (a seeded choice in
    rollout-id order) and waits again. ``threaded``: a background thread releases one every few ms instead."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seed: int = 0, per_tick: int = 3, threaded: bool = False):
        self.loop, self.rng, self.per_tick, self.threaded = loop, random.Random(seed), per_tick, threaded
        self.cv = threading.Condition()
        self.state: dict[tuple[str, int], str] = {}  # new / waiting / released / done
        self.futs: dict[tuple[str, int], asyncio.Future] = {}
        self.open: dict[str, int] = {}  # prompt key -> sessions, until its _run_prompt returned
        self.canon = lambda key: key
        self.stop = False
        if threaded:
            threading.Thread(target=self._run, daemon=True).start()

    def received(self, uid: str, n: int) -> None:
        with self.cv:
            self.open[uid] = n
            for s in range(n):
                self.state[(uid, s)] = "new"

    async def wait_for_turn(self, uid: str, s: int) -> None:
        fut = self.loop.create_future()
        with self.cv:
            self.state[(uid, s)] = "waiting"
            self.futs[(uid, s)] = fut
            self.cv.notify_all()
        await fut

    def session_done(self, uid: str, s: int) -> None:
        with self.cv:
            self.state[(uid, s)] = "done"
            self.futs.pop((uid, s), None)
            self.cv.notify_all()

    def prompt_done(self, uid: str) -> None:
        with self.cv:
            for s in range(self.open.pop(uid, 0)):
                self.state.pop((uid, s), None)
            self.cv.notify_all()

    def _quiescent(self) -> bool:
        for key, st in self.state.items():
            if st in ("new", "released") or (st == "waiting" and self.futs[key].cancelled()):
                return False
        return not any(all(self.state.get((u, s)) == "done" for s in range(n)) for u, n in self.open.items())

    def _release(self, k: int) -> None:
        with self.cv:
            waiting = sorted((key for key, st in self.state.items() if st == "waiting" and not self.futs[key].done()),
                             key=lambda key: (self.canon(key) is None, self.canon(key) or (0, 0), key))
            for key in self.rng.sample(waiting, min(k, len(waiting))):
                self.state[key] = "released"
                self.loop.call_soon_threadsafe(_resolve, self.futs[key])

    def tick(self) -> None:
        if self.threaded:
            time.sleep(0.005)
            return
        with self.cv:
            assert self.cv.wait_for(self._quiescent, timeout=60), f"workers did not settle: {self.state}"
        self._release(self.per_tick)
        with self.cv:
            assert self.cv.wait_for(self._quiescent, timeout=60), f"workers did not settle: {self.state}"

    def _run(self) -> None:
        while not self.stop:
            time.sleep(self.rng.uniform(0.001, 0.006))
            self._release(1)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class ScriptedWorker(worker_class()):
    """verl's ``AgentLoopWorkerTQ`` behind ``SaraWorkerMixin``; only the LLM call of a session is scripted: a
    reward drawn from the session's seed (``RATES`` by pool index) and a response of seeded length.

    Records every launched row (``launches``: uid, ``__rollout_n__``, seeds) and how each session ended
    (``outcomes``: landed / cancelled / failed). ``fail_once``: pool indices whose first session raises.
    """

    def __init__(self, config: Any, clock: Clock, *, fail_once: tuple[int, ...] = (), cancel: bool = True) -> None:
        self.config = config  # AgentLoopWorker.__init__ needs a tokenizer and an LLM client: the class boundary
        self.clock, self.fail_once, self.can_cancel = clock, set(fail_once), cancel
        self.background_tasks: set = set()
        self.processor = self.tokenizer = None
        self.distillation_enabled = False
        self.reward_loop_worker_handles = None
        self.launches: list[tuple[str, int, tuple[int, ...]]] = []
        self.outcomes: dict[tuple[str, int], str] = {}
        self._landed: set[tuple[str, int]] = set()
        self.seeds_seen: dict[tuple[str, int], int] = {}

    async def generate_sequences(self, batch: Any) -> None:
        if SEEDS in batch.keys():
            for uid, n, seeds in zip(list(batch["uid"]), batch["__rollout_n__"].tolist(), list(batch[SEEDS])):
                self.launches.append((str(uid), int(n), tuple(int(s) for s in seeds)))
                self.clock.received(str(uid), int(n))
        return await super().generate_sequences(batch)

    async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False) -> None:
        uid = str(prompt["uid"])
        try:
            await super()._run_prompt(prompt, sampling_params, trajectory=trajectory, trace=trace)
        finally:
            self.clock.prompt_done(uid)

    async def _run_agent_loop(self, sampling_params: dict, trajectory: dict, **kwargs: Any) -> Any:
        key = (str(kwargs["uid"]), int(kwargs["session_id"]))
        training = SEEDS in kwargs
        try:
            out = await super()._run_agent_loop(sampling_params, trajectory, **kwargs)
            if training:
                self.outcomes[key] = "landed" if key in self._landed else "cancelled"
            return out
        except Exception:
            self.outcomes[key] = "failed"
            raise
        finally:
            if training:
                self.clock.session_done(*key)

    async def sara_cancel(self, locs: Any) -> list[tuple[str, int]]:
        return await super().sara_cancel(locs) if self.can_cancel else []

    async def _sara_session(self, sampling_params: dict, trajectory: dict, **kwargs: Any) -> Any:
        key = (str(kwargs["uid"]), int(kwargs["session_id"]))
        pool = int(kwargs["index"])
        seed = int(sampling_params.get("seed", abs(hash(key)) % (1 << 62)))
        if not trajectory["validate"]:
            self.seeds_seen[key] = seed
            await self.clock.wait_for_turn(*key)
            if pool in self.fail_once:
                self.fail_once.discard(pool)
                raise RuntimeError(f"scripted failure of {key}")
        u = float(uniform_from_seeds(np.asarray([seed], np.uint64))[0])
        reward = 1.0 if u < RATES[pool % len(RATES)] else 0.0
        length = 2 + int(u * 1000) % 5
        output = AgentLoopOutput(prompt_ids=[101, 102, 103, 100 + pool % 50],
                                 response_ids=[200 + (seed >> (4 * i)) % 700 for i in range(length)],
                                 response_mask=[1] * length, reward_score=reward, num_turns=2,
                                 metrics=AgentLoopMetrics(), extra_fields={"reward_extra_info": {"acc": reward}})
        result = await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)
        self._landed.add(key)
        return result


class InProcessManager(SaraAgentLoopManager):
    """``SaraAgentLoopManager`` whose workers run on an asyncio loop thread of this process (the Ray transport is
    the class boundary: ``create`` builds Ray actors)."""

    def __init__(self, config: Any, workers: list[ScriptedWorker], loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(config, workers)
        self.loop = loop

    def _call_all(self, calls: Any) -> list[Any]:
        futs = [asyncio.run_coroutine_threadsafe(getattr(w, m)(*a), self.loop) for w, m, a in calls]
        return [f.result(timeout=60) for f in futs]


class Rig:
    """A real ``PPOTrainerSync`` with the scripted rollout side: ``step()`` runs what ``PPOTrainer.step`` runs up to
    the advantages (prepare_step, the sampler, padding, GRPO), then ``fit``'s ``kv_clear``."""

    def __init__(self, config: Any, *, seed: int = 0, threaded: bool = False, workers: int = 2,
                 fail_once: tuple[int, ...] = (), cancel: bool = True, prompts: int = 64, dataset: Any = None) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
        from verl.utils.dataset.rl_dataset import collate_fn

        start_tq()
        stale = list((tq.kv_list(TRAIN) or {}).get(TRAIN, {}) or {})
        if stale:  # what a failed earlier test left behind
            tq.kv_clear(keys=stale, partition_id=TRAIN)
        self.config = config
        self.trainer = PPOTrainerSync(config)
        self.sampler = self.trainer.replay_buffer
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.clock = Clock(self.loop, seed=seed, threaded=threaded)
        self.workers = [ScriptedWorker(config, self.clock, fail_once=fail_once if i == 0 else (), cancel=cancel)
                        for i in range(workers)]
        self.manager = InProcessManager(config, self.workers, self.loop)
        self.trainer.agent_loop_manager = self.manager  # PPOTrainer.fit() sets it
        rows = prompt_rows(prompts) if dataset is None else dataset
        self.trainer.train_dataset = rows
        self.trainer.train_dataloader = StatefulDataLoader(rows, batch_size=int(config.data.gen_batch_size),
                                                           shuffle=False, drop_last=True, collate_fn=collate_fn)
        self.trainer.train_dataloader_it = None
        self.sampler.idle = self.clock.tick
        self.clock.canon = lambda key: (self.sampler.last_env.rollout_id(*key) if self.sampler.last_env else None)
        self.reports: list[dict[str, Any]] = []

    def close(self) -> None:
        self.clock.stop = True
        self.loop.call_soon_threadsafe(self.loop.stop)

    def step(self, step: int) -> dict[str, Any]:
        """One training step's sampling; returns what the checks need (before the batch is cleared)."""
        from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size

        launches0 = [len(w.launches) for w in self.workers]
        self.trainer.global_steps = step
        self.trainer.prepare_step()
        batch, metrics = self.sampler.sample(global_steps=step, partition_id=TRAIN,
                                             batch_size=int(self.config.data.train_batch_size))
        env, result = self.sampler.last_env, self.sampler.last_result
        fields = tq.kv_batch_get(keys=batch.keys, partition_id=TRAIN, select_fields=["uid", "rm_scores"])
        uid_field = [str(u) for u in fields["uid"]]
        n_real = len(batch.keys)
        padded = upsample_batch_to_divisible_size(batch, 8, eos_token_id=2)
        data = tq.kv_batch_get(keys=padded.keys, partition_id=TRAIN, select_fields=["response_mask"])
        old_lp = torch.nested.as_nested_tensor([torch.zeros(t.numel()) for t in data["response_mask"].unbind()],
                                               layout=torch.jagged)
        from tensordict import TensorDict

        tq.kv_batch_put(keys=padded.keys, partition_id=TRAIN,
                        fields=TensorDict({"old_log_probs": old_lp}, batch_size=[len(padded.keys)]))
        adv_metrics: dict[str, Any] = {}
        self.trainer._compute_advantage(padded, metrics=adv_metrics)
        out = tq.kv_batch_get(keys=padded.keys, partition_id=TRAIN, select_fields=["uid", "advantages", "rm_scores"])
        adv: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for u, a, r in zip(list(out["uid"]), out["advantages"].unbind(), out["rm_scores"].unbind()):
            adv[str(u)].append((float(r.sum()), float(a.reshape(-1)[0]) if a.numel() else 0.0))
        tq.kv_clear(keys=padded.keys, partition_id=TRAIN)  # PPOTrainer.fit(), step 7
        leftover = (tq.kv_list(TRAIN) or {}).get(TRAIN, {}) or {}
        launches = [x for w, i in zip(self.workers, launches0) for x in w.launches[i:]]
        report = {"step": step, "batch_keys": list(batch.keys), "uid_field": uid_field, "metrics": metrics,
                  "result": result, "env": env, "launches": launches, "leftover": dict(leftover),
                  "advantages": dict(adv), "n_real": n_real, "n_padded": len(padded.keys)}
        self.reports.append(report)
        return report


def outcomes(rig: Rig) -> Counter:
    """How every session the workers ran ended, over the whole run."""
    return Counter(o for w in rig.workers for o in w.outcomes.values())


def test_clock_releases_in_a_seeded_order():
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    orders = []
    for _ in range(2):
        clock = Clock(loop, seed=3, per_tick=2)
        done: list[tuple[str, int]] = []
        clock.received("u", 5)

        async def session(s: int, clock: Clock = clock, done: list = done) -> None:
            await clock.wait_for_turn("u", s)
            done.append(("u", s))
            clock.session_done("u", s)
            if len(done) == 5:
                clock.prompt_done("u")  # what _run_prompt's end reports

        futs = [asyncio.run_coroutine_threadsafe(session(s), loop) for s in range(5)]
        while len(done) < 5:
            clock.tick()
        for f in futs:
            f.result(timeout=5)
        orders.append(list(done))
    loop.call_soon_threadsafe(loop.stop)
    assert orders[0] == orders[1] and sorted(orders[0]) == [("u", s) for s in range(5)]
