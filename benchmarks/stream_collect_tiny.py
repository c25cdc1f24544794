"""SARA's collection step on the tiny backend three ways: synchronous rounds (``collect``), streaming
(``collect_stream``), and one full ``generate`` call of the same rollouts (the engine's ceiling: no allocation).

The policy is ``sara train``'s default tiny policy, warm-started on the default task (cached under the sara cache
directory after the first run). Every driver runs ``--steps`` steps (seeds 0, 1, ...) of ``--groups`` groups of
``k``; the full batch regenerates exactly the (prompt, seed) pairs the synchronous run delivered. Tokens/s counts the
tokens generated (aborted rollouts' partial tokens included for the streaming driver); the three ways run
interleaved ``--repeats`` times and the medians are reported (the runs are deterministic: only timings vary).

Run: nice python benchmarks/stream_collect_tiny.py [--steps 3] [--groups 32] [--k 8] [--slots 256] [--threads 1] [--repeats 3]
     [--allocator sara]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--allocator", default="sara")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import torch
    from sara.collect_stream import collect_stream

    from sara.allocators import make_allocator
    from sara.backends.tiny import TinyBackend
    from sara.driver import collect
    from sara.envs.base import GenerationRequest
    from sara.envs.task_env import TaskEnv
    from sara.envs.tasks import make_task
    from sara.policies import POLICIES
    from sara.samplers import UniformSampler
    from sara.train import TrainConfig

    torch.set_num_threads(args.threads)
    task = make_task(TrainConfig().task)
    policy = POLICIES.get("tiny")({}, task=task, seed=0, verbose=True)
    env = TaskEnv(task, TinyBackend(policy, {"slots": args.slots}), scorer_mode="inline")
    def run_driver(name: str, driver) -> tuple[dict, list]:
        tokens = rollouts = effective = aborted = 0
        inflight, delivered = [], []
        t0 = time.perf_counter()
        for s in range(args.steps):
            res = driver(make_allocator(args.allocator, k=args.k), env, UniformSampler(len(env.prompts), seed=s),
                         target_groups=args.groups, seed=s)
            st = res.stats
            tokens += st.tokens + st.aborted_tokens
            rollouts, effective = rollouts + st.rollouts, effective + st.effective_groups
            aborted += st.aborted_rollouts
            inflight.append(st.mean_inflight)
            delivered += [(g.pool_index, r.seed) for g in (*res.groups, *res.abandoned, *res.discarded)
                          for r in g.rollouts]
        wall = time.perf_counter() - t0
        return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "rollouts": rollouts,
                "aborted_rollouts": aborted, "effective_groups": effective,
                "rollouts_per_effective_group": round(rollouts / max(effective, 1), 2),
                "mean_inflight": round(sum(inflight) / len(inflight), 1)}, delivered

    def full_batch(delivered: list) -> dict:
        reqs = [GenerationRequest(prompt=task.render(env.prompts[p]), seeds=(seed,)) for p, seed in delivered]
        t0 = time.perf_counter()
        out = env.backend.generate(reqs, env.sampling)
        wall = time.perf_counter() - t0
        tokens = sum(o[0].num_tokens for o in out)
        return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "rollouts": len(reqs)}

    # Interleaved repeats (the machine may be shared): medians of tokens/s per way.
    runs: dict[str, list[dict]] = {"sync": [], "stream": [], "full_batch": []}
    for _ in range(args.repeats):
        row, delivered = run_driver("sync", collect)
        runs["sync"].append(row)
        runs["stream"].append(run_driver("stream", collect_stream)[0])
        runs["full_batch"].append(full_batch(delivered))
    rows = {}
    for name, rs in runs.items():
        rows[name] = {**rs[0], "seconds": round(statistics.median(r["seconds"] for r in rs), 2),
                      "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rs), 1),
                      "tokens_per_s_all": [round(r["tokens_per_s"], 1) for r in rs]}
    rows["ratios"] = {"stream_over_sync": round(rows["stream"]["tokens_per_s"] / rows["sync"]["tokens_per_s"], 2),
                      "stream_over_full_batch": round(rows["stream"]["tokens_per_s"]
                                                      / rows["full_batch"]["tokens_per_s"], 2),
                      "sync_over_full_batch": round(rows["sync"]["tokens_per_s"]
                                                    / rows["full_batch"]["tokens_per_s"], 2)}
    print(json.dumps({"args": vars(args), "rows": rows}, indent=1))
