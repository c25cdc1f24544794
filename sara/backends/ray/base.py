"""``RayPool``: the machinery both pools share: actors, sharded rounds with restarts, the weight broadcast.

A round (one call) is cut into one shard per worker (``split_round``, balanced by expected tokens); a shard whose
worker died, was killed, timed out or raised is sent again, unchanged, to a fresh actor holding the current weights.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from sara.backends.ray.actor import StaleWeightsError, Worker, WorkerFailedError
from sara.backends.ray.cluster import init_ray
from sara.backends.ray.config import Factory, RayPoolConfig
from sara.backends.ray.splitter import split_round
from sara.config import ConfigError, validate_config
from sara.envs.base import GenerationRequest
from sara.types import RolloutRequest

__all__ = ["RayPool", "last_error_line"]

R = TypeVar("R", GenerationRequest, RolloutRequest)


class RayPool:
    """Shared machinery: actors, sharded calls with restarts, weight broadcast."""

    _kind = "pool"

    def __init__(self, factory: Factory, config: RayPoolConfig | Mapping[str, Any] | None = None,
                 **overrides: Any) -> None:
        if isinstance(config, RayPoolConfig):  # (a subclass such as RayTrainOptions may carry more fields)
            data = {k: v for k, v in config.model_dump().items() if k in RayPoolConfig.model_fields}
        else:
            data = dict(config or {})
        cfg = validate_config(RayPoolConfig, {**data, **overrides}, what=f"Ray {self._kind}")
        if not (callable(factory) or isinstance(factory, str)):
            raise ConfigError(f"Ray {self._kind}: field 'factory': expected a picklable callable or a backend spec "
                              f"string, got {type(factory).__name__}")
        import ray

        self._ray = ray
        self.config = cfg
        self.factory = factory
        self.version = 0
        self.restarts = [0] * cfg.num_workers
        """Restarts so far, per worker."""
        self.rounds = 0
        self._imbalance = 1.0
        self._failures = [0] * cfg.num_workers  # consecutive
        self._weights: Any = None  # object ref of the latest state
        self._closed = False
        self.actors: list[Any] = []
        self._factory_ref: Any = None
        self._owns_ray = init_ray(cfg.address, log_to_driver=cfg.log_to_driver)
        try:
            self._check_resources()
            self._actor_cls = ray.remote(Worker)
            self._factory_ref = ray.put(factory)  # shipped once (it may hold a policy's weights), read by every actor
            self.actors = [self._spawn(w) for w in range(cfg.num_workers)]
            for w in range(cfg.num_workers):  # wait for construction; restart workers that fail to start
                self._guard(w, "starting", lambda w=w: ray.get(self.actors[w].info.remote()))
        except BaseException:
            self.close()
            raise

    @property
    def num_workers(self) -> int:
        return self.config.num_workers

    # ---- actors
    def _check_resources(self) -> None:
        """Refuse actor resources the cluster can never provide (Ray would wait forever without an error)."""
        c = self.config
        total = self._ray.cluster_resources()
        need = {"CPU": c.num_cpus, "GPU": c.num_gpus, **c.resources}
        for name, amount in need.items():
            if amount > total.get(name, 0.0):
                field = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(name, "resources")
                raise ConfigError(f"Ray {self._kind}: field '{field}': each worker needs {amount} {name} but the "
                                  f"cluster has {total.get(name, 0.0)}")
        for name, amount in need.items():
            if amount * c.num_workers > total.get(name, 0.0):
                logging.getLogger(__name__).warning(
                    "Ray %s: %d workers need %s %s in all but the cluster has %s; some workers will wait",
                    self._kind, c.num_workers, amount * c.num_workers, name, total.get(name, 0.0))

    def _spawn(self, w: int) -> Any:
        c = self.config
        opts: dict[str, Any] = dict(num_cpus=c.num_cpus, num_gpus=c.num_gpus, max_restarts=0, max_task_retries=0)
        if c.resources:
            opts["resources"] = dict(c.resources)
        if c.runtime_env:
            opts["runtime_env"] = dict(c.runtime_env)
        return self._actor_cls.options(**opts).remote(self._factory_ref, w, c.micro_batch)

    def _describe_factory(self) -> str:
        f = self.factory
        if isinstance(f, str):
            return f
        inner = f.func if isinstance(f, functools.partial) else f
        return getattr(inner, "__qualname__", type(inner).__name__)

    def _fail(self, w: int, doing: str, exc: BaseException) -> None:
        """Record a failure of worker ``w``; replace it by a fresh actor holding the current weights, or give up.

        A factory that raises while building the backend is not retried (it is deterministic: a bad option, a
        missing model); anything else (the process died, was killed, timed out, the backend raised) is retried on a
        fresh actor until the worker has failed ``max_restarts + 1`` times in a row.
        """
        ray = self._ray
        self._on_lost(w, doing, exc)
        while True:
            self._failures[w] += 1
            if getattr(exc, "actor_init_failed", False):
                raise WorkerFailedError(f"Ray worker {w} of {self.num_workers} ({self._describe_factory()}) could "
                                        f"not build its backend while {doing}: {last_error_line(exc)}") from exc
            if self._failures[w] > self.config.max_restarts:
                raise WorkerFailedError(
                    f"Ray worker {w} of {self.num_workers} ({self._describe_factory()}) failed "
                    f"{self._failures[w]} times in a row while {doing}; last error: {last_error_line(exc)}") from exc
            try:
                ray.kill(self.actors[w], no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
            self.restarts[w] += 1
            self.actors[w] = self._spawn(w)
            try:
                ray.get(self.actors[w].info.remote())
                if self._weights is not None:
                    ray.get(self.actors[w].load_weights.remote(self._weights, self.version))
                return
            except (ray.exceptions.RayError, TimeoutError) as e:  # failed again while restarting
                exc = e

    def _on_lost(self, w: int, doing: str, exc: BaseException) -> None:
        """Called once per failure of worker ``w``, before it is replaced (the streaming pools re-issue its work)."""

    def _guard(self, w: int, doing: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (a blocking call on worker ``w``), restarting the worker and retrying on failure."""
        ray = self._ray
        while True:
            try:
                out = fn()
            except (ray.exceptions.RayError, TimeoutError) as exc:
                self._check_stale(exc)
                self._fail(w, doing, exc)
                continue
            self._failures[w] = 0
            return out

    def _check_stale(self, exc: BaseException) -> None:
        if isinstance(exc, StaleWeightsError):
            raise exc
        cause = getattr(exc, "cause", None)
        if isinstance(cause, StaleWeightsError):
            raise StaleWeightsError(str(cause)) from exc

    def _run_shards(self, method: str, payloads: dict[int, tuple[Any, ...]], doing: dict[int, str]) -> dict[int, Any]:
        """Call ``method(*payloads[w])`` on each worker ``w`` in parallel; failed shards are retried on a restarted
        worker with the same payload. Returns ``{w: result}``."""
        ray = self._ray
        timeout = self.config.call_timeout_s
        pending: dict[Any, tuple[int, float]] = {}

        def submit(w: int) -> None:
            ref = self.actors[w].call.remote(method, self.version, *payloads[w])
            pending[ref] = (w, time.monotonic())

        for w in payloads:
            submit(w)
        results: dict[int, Any] = {}
        while pending:
            wait_s = None
            if timeout is not None:
                wait_s = max(0.0, min(t0 for _, t0 in pending.values()) + timeout - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            if not ready:  # the oldest shard timed out
                ref = min(pending, key=lambda r: pending[r][1])
                w, _ = pending.pop(ref)
                self._fail(w, doing[w], TimeoutError(f"no result after {timeout} s"))  # kills the stuck actor
                submit(w)
                continue
            ref = ready[0]
            w, _ = pending.pop(ref)
            try:
                results[w] = ray.get(ref)
            except ray.exceptions.RayError as exc:
                self._check_stale(exc)
                self._fail(w, doing[w], exc)
                submit(w)
                continue
            self._failures[w] = 0
        return results

    def _sharded(self, requests: Sequence[R], key: Callable[[R], Any], default_tokens: Callable[[R], float],
                 call: Callable[[int, list[R]], tuple[tuple[Any, ...], str]], method: str,
                 tokens_of: Callable[[Any], int]) -> list[list[Any]]:
        """Split ``requests`` over the workers, run them, reassemble ``out[i]`` (``requests[i].n`` items each)."""
        self._check_open()
        self.rounds += 1
        if not requests:
            return []
        counts = [r.n for r in requests]
        if self.config.balance == "tokens":
            costs = [r.n * self._estimator.expected(key(r), default_tokens(r)) for r in requests]
        else:
            costs = [float(n) for n in counts]
        shards = split_round(costs, counts, self.num_workers, split_requests=self.config.split_requests)
        loads = [sum(costs[i] * (b - a) / counts[i] for i, a, b in pieces) for pieces in shards]
        self._imbalance = max(loads) / (sum(loads) / self.num_workers) if sum(loads) > 0 else 1.0
        payloads: dict[int, tuple[Any, ...]] = {}
        doing: dict[int, str] = {}
        for w, pieces in enumerate(shards):
            if not pieces:
                continue
            sub = [requests[i] if (a, b) == (0, requests[i].n) else dataclasses.replace(requests[i],
                                                                                      seeds=requests[i].seeds[a:b])
                   for i, a, b in pieces]
            payloads[w], what = call(w, sub)
            doing[w] = (f"{what} (round {self.rounds}: {len(sub)} requests, {sum(b - a for _, a, b in pieces)} "
                        f"rollouts, weights version {self.version})")
        results = self._run_shards(method, payloads, doing)
        out: list[list[Any]] = [[None] * n for n in counts]
        for w, pieces in enumerate(shards):
            if not pieces:
                continue
            res = results[w]
            if len(res) != len(pieces) or any(len(r) != b - a for r, (_, a, b) in zip(res, pieces)):
                raise RuntimeError(f"Ray worker {w}: {method} returned a wrong number of results for its shard")
            for r, (i, a, b) in zip(res, pieces):
                out[i][a:b] = r
        for r, items in zip(requests, out):
            self._estimator.observe(key(r), [tokens_of(x) for x in items])
        return out

    # ---- weights
    def update_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Broadcast new weights: one ``ray.put``, every actor loads them before this returns.

        Args:
            state_dict: The policy's weights (any picklable mapping; torch tensors travel through the object store).
            version: Must be larger than the current version (the trainer adds one per update).
        """
        self._check_open()
        if int(version) <= self.version:
            raise ValueError(f"Ray {self._kind}: weights version must increase; got {version} after {self.version}")
        ray = self._ray
        self._weights = ray.put(dict(state_dict))
        self.version = int(version)
        ref = self._weights
        refs = [a.load_weights.remote(ref, self.version) for a in self.actors]
        for w, r in enumerate(refs):
            try:
                ray.get(r)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                self._check_stale(exc)
                self._fail(w, f"loading weights version {self.version}", exc)  # the restart loads the new weights
            else:
                self._failures[w] = 0
        # every (possibly restarted) actor now holds self.version
        versions = ray.get([a.info.remote() for a in self.actors])
        bad = [v["index"] for v in versions if v["version"] != self.version]
        if bad:
            raise StaleWeightsError(f"Ray {self._kind}: workers {bad} do not hold weights version {self.version}")

    def metrics(self) -> dict[str, float]:
        """``ray/...`` counters: workers, rounds, restarts, weights version, expected-cost imbalance of the last round
        (slowest shard / mean shard; 1.0 = perfectly balanced)."""
        return {"ray/workers": float(self.num_workers), "ray/rounds": float(self.rounds),
                "ray/restarts": float(sum(self.restarts)), "ray/weights_version": float(self.version),
                "ray/last_round_imbalance": float(self._imbalance)}

    def worker_info(self) -> list[dict[str, Any]]:
        """``[{index, version, pid, type}]`` of the live actors."""
        return self._ray.get([a.info.remote() for a in self.actors])

    # ---- lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"Ray {self._kind} is closed")

    def close(self) -> None:
        """Close the workers' backends, kill the actors (and shut Ray down if this pool started it)."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=30)
        except Exception:  # noqa: BLE001 - best effort: the actors are killed next anyway
            pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
        self._weights = self._factory_ref = None
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def last_error_line(exc: BaseException) -> str:
    """``"Type: last line of the message"`` (Ray wraps the worker's traceback; its last line is the error)."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1].strip() if lines else ''}"[:500]

