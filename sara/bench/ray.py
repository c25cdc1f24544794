"""``sara bench ray``: throughput of the Ray pools (``sara.backends.ray``) on engines that only sleep, so the numbers
measure the pool, not a model.

* ``ray_scaling``: rollout throughput of a ``RayEnvPool`` with 1 vs 2 (or more) workers. Every worker owns a
  ``SimulatedEnv`` wrapped in ``LatencyEnv`` (a round sleeps ``seconds_per_token`` per generated token, like an
  accelerator-bound engine: the wait does not use the host CPU), and ``sara.driver.collect`` runs GRPO-sized
  ``sara_paper`` steps through the pool. The steps are the same whatever the number of workers (same seeds); only
  the wall time changes. Also measured: the pool splitting rounds by rollout count instead of expected tokens.
* ``ray_stream``: a ``RayRolloutPool`` in synchronous rounds (``generate``) vs streaming (``submit`` / ``poll`` with
  slot refill), same work. Every actor owns a ``SleepTickEngine``: a continuous-batching engine in miniature whose
  decode tick (all running completions gain one token) sleeps ``tick_s``; completion lengths are long-tailed (a
  function of the seed, 1..max_tokens). Rounds: ``pool.slots`` requests per ``generate`` call, each call lasting as
  long as its longest completion. Streaming: ``pool.slots`` completions kept in flight, refilled as they finish. Both
  generate the same completions (checked); only the wall time differs.

Both start a local Ray cluster unless one is running (and stop the one they started).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np

__all__ = ["SleepTickEngine", "format_scaling", "ray_scaling", "ray_stream"]


class SleepTickEngine:
    """A streaming engine whose decode tick sleeps ``tick_s`` (``generate`` = ticks until the longest finishes)."""

    per_request_seeds = True

    def __init__(self, slots: int, tick_s: float, max_tokens: int) -> None:
        self.slots, self.tick_s, self.max_tokens = slots, tick_s, max_tokens
        self.live: dict[int, list[int]] = {}  # tag -> [seed, tokens so far]

    def length(self, seed: int) -> int:
        """The completion length of ``seed``: exponential with mean ~8.5, capped at ``max_tokens``."""
        u = np.random.default_rng(seed).random()
        return int(min(self.max_tokens, 1 + np.floor(-8.0 * np.log1p(-u))))

    def _completion(self, seed: int, n: int) -> Any:
        from sara.envs.base import Completion

        return Completion(text="x" * n, token_ids=(1,) * n, logprobs=(-1.0,) * n, seed=seed)

    def generate(self, requests: Any, sampling: Any) -> list[list[Any]]:
        n = max((self.length(s) for r in requests for s in r.seeds), default=0)
        time.sleep(n * self.tick_s)
        return [[self._completion(s, self.length(s)) for s in r.seeds] for r in requests]

    def submit(self, items: Any, sampling: Any) -> None:
        for tag, r in items:
            self.live[tag] = [r.seeds[0], 0]

    def poll(self, timeout: float | None = None) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        while self.live and not out:
            time.sleep(self.tick_s)
            for tag in list(self.live)[: self.slots]:
                row = self.live[tag]
                row[1] += 1
                if row[1] >= self.length(row[0]):
                    out.append((tag, self._completion(row[0], row[1])))
                    del self.live[tag]
        return out

    def abort(self, tags: Any) -> int:
        return sum(self.live.pop(t)[1] for t in tags if t in self.live)

    def inflight(self) -> int:
        return len(self.live)

    def update_weights(self, state: Any, version: int) -> None:
        pass

    def close(self) -> None:
        pass


def _ray(num_cpus: int) -> bool:
    from sara.backends.ray import init_ray

    return init_ray(num_cpus=num_cpus)


def _shutdown(started: bool) -> None:
    if started:
        import ray

        ray.shutdown()


def _steps(env: Any, steps: int, target: int, k: int) -> dict[str, float]:
    """``steps`` collection steps of ``sara_paper``; wall time and totals."""
    from sara.allocators import make_allocator
    from sara.driver import collect
    from sara.samplers import UniformSampler

    alloc = make_allocator("sara_paper", k=k)
    sampler = UniformSampler(len(env.prompts), seed=0)
    t0 = time.perf_counter()
    rollouts = tokens = 0
    for _ in range(steps):
        res = collect(alloc, env, sampler, target_groups=target, seed=0)
        rollouts += res.stats.rollouts
        tokens += res.stats.tokens
    wall = time.perf_counter() - t0
    return {"seconds": wall, "rollouts": rollouts, "tokens": tokens, "rollouts_per_s": rollouts / wall,
            "tokens_per_s": tokens / wall}


def ray_scaling(workers: tuple[int, ...] = (1, 2), *, seconds_per_token: float = 1e-5, steps: int = 5,
                target: int = 32, k: int = 8, pool_size: int = 20_000) -> dict[str, Any]:
    """Rollout throughput of a ``RayEnvPool`` per worker count (see the module docstring).

    Returns:
        ``{"config": {...}, "rows": [{workers, balance, seconds, rollouts, tokens, rollouts_per_s, tokens_per_s,
        speedup}]}``; ``speedup`` is tokens/s over the first row's (the first worker count, split by tokens).
    """
    from sara.backends.ray import RayEnvPool
    from sara.envs import SimulatedEnv
    from sara.envs.sim.latency import LatencyEnv

    config = {"workers": list(workers), "seconds_per_token": seconds_per_token, "steps": steps, "target": target,
              "k": k, "pool_size": pool_size}
    started = _ray(max(2, *workers))
    try:
        sim = functools.partial(SimulatedEnv, "u-shaped", size=pool_size, seed=0)
        factory = functools.partial(LatencyEnv, sim, seconds_per_token)
        rows: list[dict[str, Any]] = []
        for balance in ("tokens", "requests"):
            for w in workers:
                if balance == "requests" and w == 1:
                    continue  # one worker gets the whole round either way
                with RayEnvPool(factory, num_workers=w, balance=balance) as pool:
                    _steps(pool, 1, target, k)  # warm-up (worker imports), not timed
                    rows.append({"workers": w, "balance": balance, **_steps(pool, steps, target, k)})
    finally:
        _shutdown(started)
    base = rows[0]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
    return {"config": config, "rows": rows}


def format_scaling(report: dict[str, Any]) -> str:
    """``ray_scaling``'s report as a table."""
    c, base = report["config"], report["rows"][0]
    lines = [f"simulator + {c['seconds_per_token']:g} s/token latency, sara_paper k={c['k']}, {c['steps']} steps of "
             f"{c['target']} groups ({base['rollouts']} rollouts, {base['tokens']} tokens)",
             f"{'workers':>7} {'split by':>9} {'seconds':>8} {'rollouts/s':>11} {'tokens/s':>10} {'speed-up':>9}"]
    for r in report["rows"]:
        lines.append(f"{r['workers']:>7} {r['balance']:>9} {r['seconds']:>8.2f} {r['rollouts_per_s']:>11.0f} "
                     f"{r['tokens_per_s']:>10.0f} {r['speedup']:>8.2f}x")
    return "\n".join(lines)


def ray_stream(*, workers: int = 2, slots: int = 8, completions: int = 400, tick_s: float = 0.004,
               max_tokens: int = 64) -> dict[str, Any]:
    """Rounds vs streaming on a ``RayRolloutPool`` of ``SleepTickEngine`` actors (see the module docstring).

    Returns:
        ``{workers, slots (the pool's), completions, tokens, tick_s, rounds_seconds, stream_seconds, speedup}``.
    """
    from sara.backends.ray import RayRolloutPool
    from sara.envs.base import GenerationRequest, SamplingConfig

    sampling = SamplingConfig(max_new_tokens=max_tokens)
    reqs = [GenerationRequest(prompt="p", seeds=(s,)) for s in range(completions)]
    engine = functools.partial(SleepTickEngine, slots, tick_s, max_tokens)
    started = _ray(max(2, workers))
    try:
        with RayRolloutPool(engine, num_workers=workers, balance="requests") as pool:
            per_round = pool.slots
            t0 = time.perf_counter()
            rounds = [c for lo in range(0, len(reqs), per_round)
                      for cs in pool.generate(reqs[lo: lo + per_round], sampling) for c in cs]
            t_rounds = time.perf_counter() - t0
            t0 = time.perf_counter()
            got: dict[int, Any] = {}
            nxt = 0
            while len(got) < len(reqs):
                free = min(pool.slots - pool.inflight(), len(reqs) - nxt)
                if free > 0:
                    pool.submit([(t, reqs[t]) for t in range(nxt, nxt + free)], sampling)
                    nxt += free
                got.update(pool.poll())
            t_stream = time.perf_counter() - t0
    finally:
        _shutdown(started)
    if [(got[t].seed, got[t].token_ids) for t in range(len(reqs))] != [(c.seed, c.token_ids) for c in rounds]:
        raise AssertionError("ray stream: the streamed completions differ from the rounds' (same seeds)")
    return {"workers": workers, "slots": per_round, "completions": len(reqs),
            "tokens": sum(c.num_tokens for c in rounds), "tick_s": tick_s, "rounds_seconds": round(t_rounds, 3),
            "stream_seconds": round(t_stream, 3), "speedup": round(t_rounds / t_stream, 2)}
