"""Ray pool: synchronous rounds (``generate``) vs streaming (``submit`` / ``poll`` with slot refill), same work.

Every actor owns a ``SleepTickEngine``: a continuous-batching engine in miniature whose decode tick (all running
completions gain one token) sleeps ``tick_s``, like an accelerator-bound step; completion lengths are long-tailed
(a deterministic function of the seed, 1..max_tokens). Rounds: ``slots`` requests per ``generate`` call, each call
lasting as long as its longest completion. Streaming: ``pool.slots`` completions kept in flight, refilled as they
finish. Both generate the same completions (same seeds); only the wall time differs.

Run: python benchmarks/ray_stream.py [--workers 2] [--completions 400] [--tick-s 0.004] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np

from sara.backends.ray import RayRolloutPool, init_ray
from sara.envs.base import Completion, GenerationRequest, SamplingConfig


class SleepTickEngine:
    """A streaming engine whose decode tick sleeps ``tick_s`` (``generate`` = ticks until the longest finishes)."""

    per_request_seeds = True

    def __init__(self, slots: int, tick_s: float, max_tokens: int) -> None:
        self.slots, self.tick_s, self.max_tokens = slots, tick_s, max_tokens
        self.live: dict[int, list] = {}

    def length(self, seed: int) -> int:
        u = np.random.default_rng(seed).random()
        return int(min(self.max_tokens, 1 + np.floor(-8.0 * np.log1p(-u))))  # exponential, mean ~8.5, capped

    def _completion(self, seed: int, n: int) -> Completion:
        return Completion(text="x" * n, token_ids=(1,) * n, logprobs=(-1.0,) * n, seed=seed)

    def generate(self, requests, sampling):
        n = max((self.length(s) for r in requests for s in r.seeds), default=0)
        time.sleep(n * self.tick_s)
        return [[self._completion(s, self.length(s)) for s in r.seeds] for r in requests]

    def submit(self, items, sampling):
        for tag, r in items:
            self.live[tag] = [r.seeds[0], 0]

    def poll(self, timeout=None):
        out = []
        while self.live and not out:
            time.sleep(self.tick_s)
            for tag in list(self.live)[: self.slots]:
                row = self.live[tag]
                row[1] += 1
                if row[1] >= self.length(row[0]):
                    out.append((tag, self._completion(row[0], row[1])))
                    del self.live[tag]
        return out

    def abort(self, tags):
        return sum(self.live.pop(t)[1] for t in tags if t in self.live)

    def inflight(self):
        return len(self.live)

    def update_weights(self, state, version):
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8, help="slots per actor (= requests per round per actor)")
    ap.add_argument("--completions", type=int, default=400)
    ap.add_argument("--tick-s", type=float, default=0.004)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    init_ray(num_cpus=max(2, args.workers))
    sampling = SamplingConfig(max_new_tokens=args.max_tokens)
    reqs = [GenerationRequest(prompt="p", seeds=(s,)) for s in range(args.completions)]
    engine = functools.partial(SleepTickEngine, args.slots, args.tick_s, args.max_tokens)
    with RayRolloutPool(engine, num_workers=args.workers, balance="requests") as pool:
        per_round = pool.slots
        t0 = time.perf_counter()
        rounds = [c for lo in range(0, len(reqs), per_round) for cs in pool.generate(reqs[lo: lo + per_round], sampling)
                  for c in cs]
        t_rounds = time.perf_counter() - t0
        t0 = time.perf_counter()
        got: dict[int, Completion] = {}
        nxt = 0
        while len(got) < len(reqs):
            free = min(pool.slots - pool.inflight(), len(reqs) - nxt)
            if free > 0:
                pool.submit([(t, reqs[t]) for t in range(nxt, nxt + free)], sampling)
                nxt += free
            got.update(pool.poll())
        t_stream = time.perf_counter() - t0
    # the same completions either way (streamed ones also carry metadata["weights_version"])
    assert [(got[t].seed, got[t].token_ids) for t in range(len(reqs))] == [(c.seed, c.token_ids) for c in rounds]
    tokens = sum(c.num_tokens for c in rounds)
    out = {"workers": args.workers, "slots": per_round, "completions": len(reqs), "tokens": tokens,
           "tick_s": args.tick_s, "rounds_seconds": round(t_rounds, 3), "stream_seconds": round(t_stream, 3),
           "speedup": round(t_rounds / t_stream, 2)}
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
