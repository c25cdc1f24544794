"""Rollout throughput on Ray: 1 vs 2 (or more) workers on the simulator with a synthetic per-token latency.

Every worker owns a ``SimulatedEnv`` wrapped in ``LatencyEnv`` (a round sleeps ``seconds_per_token`` per generated
token, like an accelerator-bound engine), and ``collect`` runs GRPO-sized SARA steps through ``RayEnvPool``. The
steps are identical whatever the number of workers (same seeds); only the wall time changes. Also measured: the same
pool splitting rounds by rollout count instead of expected tokens.

Run: python benchmarks/ray_scaling.py [--workers 1,2] [--seconds-per-token 1e-5] [--steps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

from sara import SimulatedEnv, UniformSampler, collect, make_allocator
from sara.backends.ray import RayEnvPool, init_ray
from sara.envs.sim.latency import LatencyEnv


def run(env, steps: int, target: int, k: int) -> dict[str, float]:
    """Run ``steps`` collection steps; return wall time and totals."""
    alloc = make_allocator("sara_paper:tau_low=0.45", k=k)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--seconds-per-token", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--target", type=int, default=32, help="committed groups per step")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--json", default="runs/bench-ray/ray_scaling.json")
    args = ap.parse_args()

    init_ray(num_cpus=max(2, max(int(w) for w in args.workers.split(","))), temp_dir="/tmp/sara-ray-bench")
    sim = functools.partial(SimulatedEnv, "u-shaped", size=20_000, seed=0)
    factory = functools.partial(LatencyEnv, sim, args.seconds_per_token)
    rows: list[dict] = []
    for balance in ("tokens", "requests"):
        for w in (int(x) for x in args.workers.split(",")):
            if balance == "requests" and w == 1:
                continue
            with RayEnvPool(factory, num_workers=w, balance=balance) as pool:
                run(pool, 1, args.target, args.k)  # warm-up (worker imports), not timed
                r = run(pool, args.steps, args.target, args.k)
            rows.append({"workers": w, "balance": balance, **r})
    base = next(r for r in rows if r["workers"] == 1)
    print(f"simulator + {args.seconds_per_token:g} s/token latency, SARA k={args.k}, {args.steps} steps of "
          f"{args.target} groups ({base['rollouts']} rollouts, {base['tokens']} tokens)")
    print(f"{'workers':>7} {'split by':>9} {'seconds':>8} {'rollouts/s':>11} {'tokens/s':>10} {'speed-up':>9}")
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(f"{r['workers']:>7} {r['balance']:>9} {r['seconds']:>8.2f} {r['rollouts_per_s']:>11.0f} "
              f"{r['tokens_per_s']:>10.0f} {r['speedup']:>8.2f}x")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
