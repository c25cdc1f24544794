"""verl's rollout side under a sara allocator: an agent-loop manager that holds admitted prompts until the allocator
starts rollouts for them, and an agent-loop worker that seeds each session and can cancel single sessions.

verl 0.9.1's V1 trainer submits prompts itself (``prepare_step``: ``data.train_batch_size`` of them every step; the
sampler's ``refill_fn``) through ``agent_loop_manager.generate_sequences``. ``SaraAgentLoopManager`` (config key
``actor_rollout_ref.rollout.agent.agent_loop_manager_class``) holds the training rows it gets there (their
TransferQueue prompt tag stays ``pending``: admitted, not started) and starts them only when ``SaraSampler`` says how
many rollouts each gets (``launch``: rows carrying ``__rollout_n__`` and one seed per session); validation batches go
straight to the workers.

The workers are verl's ``AgentLoopWorkerTQ`` with ``SaraWorkerMixin`` in front (``worker_class()``):

- each session's sampling params get the seed sara derived for that rollout (``(seed, step, prompt, occurrence, j)``),
  which vLLM honours per request;
- ``sara_cancel`` cancels sessions that have produced nothing yet (not started, or generating): the session ends
  without an output, so nothing of it reaches TransferQueue; a session already writing its output is not cancelled
  (it lands, and the sampler discards it). Cancelling a session cancels the agent loop's coroutine; whether the
  inference server stops that request too depends on the LLM client (not checked without a GPU, see docs/verl.md).

Nothing here imports verl, Ray or tensordict at import time.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sara.config import ConfigError

__all__ = ["SEEDS", "SaraAgentLoopManager", "SaraWorkerMixin", "first_value", "worker_class"]

SEEDS = "__sara_seeds__"
"""Row column with one seed per session of a launched row (popped by the worker before the agent loop runs)."""
_SEED_MASK = (1 << 63) - 1  # vLLM takes a signed 64-bit seed


def first_value(row: Any, key: str) -> Any:
    """The value of column ``key`` in the first row of a TensorDict (tensor, NonTensorStack or NonTensorData)."""
    from tensordict import NonTensorData, NonTensorStack

    v = row.get(key)
    if isinstance(v, NonTensorStack):
        return v.tolist()[0]
    if isinstance(v, NonTensorData):
        return v.data
    if hasattr(v, "reshape"):
        return v.reshape(-1)[0].item()
    return v


def _is_validation(batch: Any) -> bool:
    return "validate" in batch.keys() and bool(first_value(batch, "validate"))


def _concat(rows: Sequence[Any]) -> Any:
    from verl.utils import tensordict_utils as tu

    return rows[0] if len(rows) == 1 else tu.concat_tensordict(list(rows))


class SaraAgentLoopManager:
    """Agent-loop manager for ``SaraSampler``: holds training prompts, starts the rollouts the allocator dispatches.

    verl builds it with ``create`` (``TaskRunnerV1.init_agent_loop_manager``); it uses verl's own worker creation
    (``AgentLoopManagerTQ._init_agent_loop_workers``) with the workers of ``worker_class()``.

    Args:
        config: verl's whole config.
        workers: Ray actor handles of the agent-loop workers (``worker_class()`` actors).
    """

    def __init__(self, config: Any, workers: Sequence[Any]) -> None:
        if not workers:
            raise ConfigError("SaraAgentLoopManager: field 'workers': give at least one agent-loop worker")
        self.config = config
        self.workers = list(workers)
        self._held: OrderedDict[str, Any] = OrderedDict()  # base uid -> one-row TensorDict, in submission order
        self._worker_of: dict[str, int] = {}  # launched TransferQueue prompt key -> worker index
        self._next_worker = 0
        self.launched_rows = 0

    @classmethod
    def create(cls, config: Any, llm_client: Any, teacher_client: Any = None,
               reward_loop_worker_handles: Any = None) -> SaraAgentLoopManager:
        """What verl calls (``agent_loop_manager_class.create(config=..., llm_client=..., ...)``).

        Raises:
            ConfigError: the configured sampler is not ``SaraSampler`` (training prompts would be held forever).
        """
        import ray
        from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ
        from verl.utils.ray_utils import auto_await

        check_sampler_config(config)
        stock = AgentLoopManagerTQ(config, llm_client, teacher_client, reward_loop_worker_handles)
        stock.agent_loop_workers_class = ray.remote(worker_class())
        auto_await(stock._init_agent_loop_workers)()
        return cls(config, stock.agent_loop_workers)

    # ---- what verl calls -------------------------------------------------------------------------------------
    def generate_sequences(self, prompts: Any) -> None:
        """verl submits prompts: validation batches run at once; training rows are held until ``launch``."""
        if _is_validation(prompts):
            chunks = prompts.chunk(min(len(self.workers), len(prompts)))
            self._call_all([(w, "generate_sequences", (c,)) for w, c in zip(self.workers, chunks)])
            return
        for i in range(len(prompts)):
            row = prompts[i : i + 1]
            self._held[str(first_value(row, "uid"))] = row

    # ---- what SaraSampler calls ------------------------------------------------------------------------------
    def take_held(self) -> list[tuple[str, Any]]:
        """The held training rows ``(uid, row)`` in submission order; the manager forgets them."""
        out = list(self._held.items())
        self._held.clear()
        return out

    def launch(self, rows: Sequence[Any]) -> None:
        """Start rows (each with ``uid``, ``__rollout_n__`` and ``SEEDS`` set); one row's sessions run on one worker
        (round-robin over rows), so a cancel goes to that worker."""
        by_worker: dict[int, list[Any]] = defaultdict(list)
        for row in rows:
            w = self._next_worker % len(self.workers)
            self._next_worker += 1
            self._worker_of[str(first_value(row, "uid"))] = w
            by_worker[w].append(row)
        self._call_all([(self.workers[w], "generate_sequences", (_concat(rs),)) for w, rs in sorted(by_worker.items())])
        self.launched_rows += len(rows)

    def cancel(self, locs: Sequence[tuple[str, int]]) -> set[tuple[str, int]]:
        """Cancel sessions ``(TransferQueue prompt key, session id)`` that have produced nothing yet; returns those
        actually cancelled (they will never write an output)."""
        by_worker: dict[int, list[tuple[str, int]]] = defaultdict(list)
        for uid, s in locs:
            if uid in self._worker_of:
                by_worker[self._worker_of[uid]].append((uid, int(s)))
        got = self._call_all([(self.workers[w], "sara_cancel", (ls,)) for w, ls in sorted(by_worker.items())])
        return {(str(u), int(s)) for res in got for u, s in res}

    def forget(self, uids: Sequence[str]) -> None:
        """Drop the routing of prompt keys whose sessions have all ended."""
        for uid in uids:
            self._worker_of.pop(uid, None)

    def _call_all(self, calls: Sequence[tuple[Any, str, tuple[Any, ...]]]) -> list[Any]:
        """Call ``worker.method(*args)`` for every entry, concurrently, and wait for all (Ray actors)."""
        if not calls:
            return []
        import ray

        return ray.get([getattr(w, m).remote(*a) for w, m, a in calls])


def check_sampler_config(config: Any) -> None:
    """Raise when verl's configured sampler is not ``SaraSampler`` (the manager holds training prompts for it)."""
    custom = config.trainer.v1.sampler.get("custom_sampler", None) or {}
    path, name = str(custom.get("path") or ""), str(custom.get("name") or "")
    if "sara.integrations.verl" not in path or name != "SaraSampler":
        raise ConfigError("SaraAgentLoopManager holds training prompts until SaraSampler starts them: set "
                          "trainer.v1.sampler.custom_sampler.path=pkg://sara.integrations.verl and "
                          f"custom_sampler.name=SaraSampler (got path={path!r}, name={name!r})")


@dataclass
class _Sessions:
    """Per-worker bookkeeping of launched sessions."""

    state: dict[str, dict[int, str]] = field(default_factory=dict)  # uid -> session -> new/running/landing/cancelled
    tasks: dict[tuple[str, int], asyncio.Future] = field(default_factory=dict)


class SaraWorkerMixin:
    """Goes in front of verl's ``AgentLoopWorkerTQ`` (``worker_class()``): per-session seeds and cancellation.

    Rows launched by ``SaraAgentLoopManager`` carry ``SEEDS``; other rows (validation) run unchanged. The LLM part of
    a session is ``_sara_session`` (verl's ``_run_agent_loop``: the agent loop, then the output to TransferQueue).
    """

    @property
    def _sara(self) -> _Sessions:
        st = self.__dict__.get("_sara_sessions")
        if st is None:
            st = self.__dict__["_sara_sessions"] = _Sessions()
        return st

    async def generate_sequences(self, batch: Any) -> None:
        if SEEDS in batch.keys():
            n = batch["__rollout_n__"].reshape(-1).tolist()
            for uid, count in zip(list(batch["uid"]), n):
                self._sara.state[str(uid)] = dict.fromkeys(range(int(count)), "new")
        return await super().generate_sequences(batch)  # type: ignore[misc]

    async def _run_prompt(self, prompt: dict, sampling_params: dict, trajectory: dict, trace: bool = False) -> None:
        uid = str(prompt["uid"])
        try:
            await super()._run_prompt(prompt, sampling_params, trajectory=trajectory, trace=trace)  # type: ignore[misc]
        finally:
            self._sara.state.pop(uid, None)

    async def _run_agent_loop(self, sampling_params: dict, trajectory: dict, *, agent_name: str, trace: bool = True,
                              **kwargs: Any) -> Any:
        seeds = kwargs.pop(SEEDS, None)
        if seeds is None:  # validation, or a row sara did not start: verl's session as it is
            return await self._sara_session(sampling_params, trajectory, agent_name=agent_name, trace=trace, **kwargs)
        uid, s = str(kwargs["uid"]), int(kwargs["session_id"])
        sessions = self._sara.state.setdefault(uid, {})
        if sessions.get(s) == "cancelled":
            return None
        sessions[s] = "running"
        params = dict(sampling_params, seed=int(seeds[s]) & _SEED_MASK)
        task = asyncio.ensure_future(self._sara_session(params, trajectory, agent_name=agent_name, trace=trace,
                                                        **kwargs))
        self._sara.tasks[(uid, s)] = task
        try:
            return await task
        except asyncio.CancelledError:
            if sessions.get(s) == "cancelled" and task.cancelled():
                return None  # cancelled by sara_cancel: the session ends without an output
            raise
        finally:
            self._sara.tasks.pop((uid, s), None)

    async def _sara_session(self, sampling_params: dict, trajectory: dict, **kwargs: Any) -> Any:
        """One session: verl's agent loop (LLM calls, reward) and its output into TransferQueue."""
        return await super()._run_agent_loop(sampling_params, trajectory, **kwargs)  # type: ignore[misc]

    async def _agent_loop_postprocess(self, output: Any, validate: bool, **kwargs: Any) -> Any:
        sessions = self._sara.state.get(str(kwargs.get("uid")))
        s = int(kwargs.get("session_id", -1))
        if sessions is not None and sessions.get(s) == "running":
            sessions[s] = "landing"  # writing its output: no longer cancellable
        return await super()._agent_loop_postprocess(output, validate, **kwargs)  # type: ignore[misc]

    async def sara_cancel(self, locs: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """Cancel sessions that have produced nothing yet; returns those cancelled."""
        out = []
        for uid, s in locs:
            sessions = self._sara.state.get(str(uid), {})
            state = sessions.get(int(s))
            if state == "new":
                sessions[int(s)] = "cancelled"
                out.append((str(uid), int(s)))
            elif state == "running":
                sessions[int(s)] = "cancelled"
                self._sara.tasks[(str(uid), int(s))].cancel()
                out.append((str(uid), int(s)))
        return out


@functools.cache
def worker_class() -> type:
    """verl's ``AgentLoopWorkerTQ`` (the plain class behind its ``@ray.remote``) with ``SaraWorkerMixin`` in front;
    wrap it in ``ray.remote`` to run it as an actor."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    base = AgentLoopWorkerTQ.__ray_actor_class__
    return type("SaraAgentLoopWorker", (SaraWorkerMixin, base), {"__doc__": SaraWorkerMixin.__doc__})
