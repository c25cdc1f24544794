"""Generation throughput of SARA-style rounds vs one full batch of the same total size, on the same backend.

SARA collects a step in a few synchronous rounds (probe every fresh prompt, then extend, then complete the committed
groups), so the engine sees several smaller batches instead of one big one. This benchmark replays the round sizes of
a real SARA collection step (simulated rewards decide who is probed / extended / completed, ``sara.collect``) against
a real backend, then generates the SAME requests (same prompts, same total rollouts) as one full batch, and reports

- ``rounds``: backend calls per step for SARA (the full batch is 1),
- tokens/s of each, and ``ratio = rounds tokens/s / full-batch tokens/s`` (1.0 = no throughput cost).

Usage (CPU, SmolLM2-135M-Instruct prepared by ``sara model prepare smollm2``)::

    python benchmarks/generation_rounds.py --backend hf --groups 8 --k 8 --max-new-tokens 32
    python benchmarks/generation_rounds.py --backend vllm --groups 8 --k 8 --max-new-tokens 32

Writes a JSON report (``--json``). Sampling uses temperature 1 with ``ignore EOS`` off, so token counts differ
between the two passes; the ratio is of tokens per second, not of wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def sara_round_plan(groups: int, k: int, seed: int) -> list[list[tuple[int, tuple[int, ...]]]]:
    """The rounds of one SARA step on a simulated U-shaped pool: ``[[(pool_index, seeds), ...] per round]``."""
    from sara import SimulatedEnv, UniformSampler, collect, make_allocator

    env = SimulatedEnv("u-shaped", size=10_000, seed=seed)
    rounds: list[list[tuple[int, tuple[int, ...]]]] = []

    class Recorder:
        prompts = env.prompts

        def rollout(self, requests: Any) -> Any:
            rounds.append([(r.pool_index, tuple(r.seeds)) for r in requests])
            return env.rollout(requests)

    collect(make_allocator("sara:tau_low=0.45", k=k), Recorder(), UniformSampler(len(env.prompts), seed=seed),
            target_groups=groups, seed=seed)
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="hf", help="backend spec (hf, vllm, hf:dtype=float32, ...)")
    ap.add_argument("--task", default="sara/Countdown-v0", help="task whose prompts are generated for")
    ap.add_argument("--groups", type=int, default=8, help="committed groups per step (SARA's target)")
    ap.add_argument("--k", type=int, default=8, help="group size")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="runs/bench-generation-rounds.json")
    args = ap.parse_args()

    from sara.backends import make_backend
    from sara.envs.base import GenerationRequest, SamplingConfig
    from sara.envs.tasks import make_task

    task = make_task(args.task)
    plan = sara_round_plan(args.groups, args.k, args.seed)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new_tokens, stop=task.stop)
    prompt_of = {}

    def request(pool_index: int, seeds: tuple[int, ...]) -> GenerationRequest:
        if pool_index not in prompt_of:  # SimulatedEnv pool indices -> task prompts (same prompt, same index)
            prompt_of[pool_index] = task.render(task.prompts[pool_index % len(task.prompts)])
        return GenerationRequest(prompt=prompt_of[pool_index], seeds=seeds)

    backend = make_backend(args.backend)
    try:
        backend.generate([request(plan[0][0][0], (0,))], SamplingConfig(max_new_tokens=4))  # warm-up
        t0 = time.perf_counter()
        tok_rounds = 0
        for rnd in plan:
            out = backend.generate([request(p, s) for p, s in rnd], sampling)
            tok_rounds += sum(c.num_tokens for o in out for c in o)
        t_rounds = time.perf_counter() - t0
        merged: dict[int, list[int]] = {}
        for rnd in plan:
            for p, s in rnd:
                merged.setdefault(p, []).extend(s)
        full = [request(p, tuple(s)) for p, s in merged.items()]
        t0 = time.perf_counter()
        out = backend.generate(full, sampling)
        t_full = time.perf_counter() - t0
        tok_full = sum(c.num_tokens for o in out for c in o)
    finally:
        backend.close()
    rollouts = sum(len(s) for rnd in plan for _, s in rnd)
    report = {
        "backend": args.backend, "task": args.task, "groups": args.groups, "k": args.k,
        "max_new_tokens": args.max_new_tokens, "rollouts": rollouts, "rounds": len(plan),
        "round_sizes": [sum(len(s) for _, s in rnd) for rnd in plan],
        "rounds_seconds": t_rounds, "rounds_tokens": tok_rounds, "rounds_tok_per_s": tok_rounds / t_rounds,
        "full_seconds": t_full, "full_tokens": tok_full, "full_tok_per_s": tok_full / t_full,
    }
    report["ratio"] = report["rounds_tok_per_s"] / report["full_tok_per_s"]
    print(json.dumps(report, indent=2))
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # the guard vLLM's spawned engine needs
    raise SystemExit(main())
