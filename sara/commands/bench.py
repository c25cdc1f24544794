"""``sara bench allocation``, ``sara bench decisions``, ``sara bench generation`` and ``sara bench learner``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sara.config import validate_config


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks (allocation efficiency, decision throughput)")
    bsub = bench.add_subparsers(dest="bench", metavar="<benchmark>")

    p = bsub.add_parser("allocation", help="rollouts per effective group of allocators on a simulated prompt pool",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--population", default="u-shaped",
                   help="u-shaped | mid-training | uniform | beta:A,B | file:PATH (one success rate per line)")
    p.add_argument("--k", type=int, default=8, help="group size")
    p.add_argument("--target-groups", type=int, default=512, help="committed groups per step")
    p.add_argument("--seeds", type=int, default=3, help="independent pools (seeds 0..N-1)")
    p.add_argument("--pool-size", type=int, default=20_000, help="prompts per simulated pool")
    p.add_argument("--steps", type=int, default=1, help="collection steps per seed")
    p.add_argument("--allocators", default="uniform,ds,sara:tau_low=0.45,probe=1",
                   help="allocator specs separated by ';' or ',' between specs (name:key=value,key=value)")
    p.add_argument("--sampler", default="uniform",
                   help="prompt sampler spec for every allocator (uniform | predictive[:key=value,...]); a spec may "
                        "carry its own as SPEC@SAMPLER; the reference DS samples uniformly unless written ds@SAMPLER; "
                        "SPEC@oracle is the floor (a sampler that knows the true success rates)")
    p.add_argument("--epochs", type=float, default=None,
                   help="multi-step mode: run ceil(epochs x pool-size / target-groups) steps over the same pool "
                        "(overrides --steps); reports starvation")
    p.add_argument("--drift", type=float, default=0.0,
                   help="per-step drift of success rates on the logit scale, larger for trained prompts (see "
                        "sara.bench.allocation.drift_rates)")
    p.add_argument("--json", dest="json_out", default=None, help="write the JSON report here")
    p.add_argument("--plot", default=None, help="write the PNG plot here (default: next to --json, or runs/)")
    p.add_argument("--out", default="runs/bench-allocation", help="directory for the default JSON/PNG outputs")
    p.set_defaults(func=_allocation)

    d = bsub.add_parser("decisions", help="vectorized decision throughput of an allocator",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--units", type=int, default=1_000_000)
    d.add_argument("--rounds", type=int, default=4)
    d.add_argument("--k", type=int, default=8)
    d.add_argument("--allocator", default="sara:tau_low=0.45")
    d.set_defaults(func=_decisions)

    g = bsub.add_parser("generation", help="tokens/s and seconds per effective group of allocators on a real backend "
                        "(sync rounds vs streaming), against one full batch of the same rollouts",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--backend", default="tiny", help="tiny | hf | vllm, with options (hf:dtype=float32,...)")
    g.add_argument("--allocators", default="ds;sara;sara+stream;sara+carry",
                   help="allocator specs separated by ';'; a spec ending in '+stream' runs under the streaming driver "
                        "(sara.collect_stream) instead of synchronous rounds (sara.collect), one ending in '+carry' "
                        "under the streaming driver with carry-over into the next step")
    g.add_argument("--carry-lag", type=int, default=1, help="'+carry' specs: steps a carried unit may lag")
    g.add_argument("--complete-groups", action="store_true", help="streaming specs: a step that reaches its target "
                   "waits for the groups still being filled instead of committing them with fewer than k rollouts")
    g.add_argument("--task", default=None, help="task spec (default: the tiny policy's task for tiny; 3-shot "
                   "1-digit sums for hf / vllm)")
    g.add_argument("--groups", type=int, default=32, help="target groups per collection step")
    g.add_argument("--k", type=int, default=8, help="group size")
    g.add_argument("--steps", type=int, default=3, help="collection steps per allocator")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--seeds", type=int, default=1, help="repeat with seeds seed, seed+1, ...: pooled figures and 95%% "
                   "intervals of the ratios over seeds")
    g.add_argument("--reference", default=None, help="one of the --allocators specs (e.g. 'sara'): add the column "
                   "rollouts per effective group over its own, paired per seed")
    g.add_argument("--slots", type=int, default=None,
                   help="rollouts the streaming driver keeps in flight (default: the engine's slots)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="generation cap (default: the task's)")
    g.add_argument("--no-stop", dest="task_stop", action="store_false", help="ignore the task's stop strings: every "
                   "completion runs to --max-new-tokens (more decoding per rollout; scores unchanged on tasks that "
                   "read the answer first)")
    g.add_argument("--json", dest="json_out", default=None, help="write the JSON report here")
    g.set_defaults(func=_generation)

    lb = bsub.add_parser("learner", help="update seconds per rollout of the shipped learner vs the naive path (full "
                         "float32 forwards + a second forward for old log-probs), and FLOP/s vs the measured matmul rate",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    lb.add_argument("--model", default="smollm2", help="prepared model name or local HF model directory")
    lb.add_argument("--task", default=None, help="task spec (default: 3-shot 1-digit sums)")
    lb.add_argument("--groups", type=int, default=8, help="prompts in the batch")
    lb.add_argument("--k", type=int, default=8, help="completions per prompt")
    lb.add_argument("--max-new-tokens", type=int, default=6, help="generation cap")
    lb.add_argument("--reps", type=int, default=3, help="timed updates per path (interleaved)")
    lb.add_argument("--compute-dtype", default="bfloat16", help="the shipped path's compute dtype (auto | float32 | "
                    "bfloat16)")
    lb.add_argument("--microbatch-tokens", type=int, default=2048, help="the shipped path's micro-batch budget")
    lb.add_argument("--algo", default="grpo", help="algorithm spec")
    lb.add_argument("--seed", type=int, default=0)
    lb.add_argument("--json", dest="json_out", default=None, help="write the JSON report here")
    lb.set_defaults(func=_learner)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)


def split_specs(text: str) -> list[str]:
    """Split a list of allocator specs. Specs are separated by ';', or by ',' when the next item starts a new spec
    (contains no '=' before any ':'), so ``ds,sara:tau_low=0.45,probe=1`` is two specs."""
    if ";" in text:
        return [s.strip() for s in text.split(";") if s.strip()]
    specs: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        starts_new = "=" not in item or (":" in item and item.index(":") < item.index("="))
        if specs and not starts_new:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


def _allocation(args: argparse.Namespace) -> int:
    from sara.bench.allocation import (
        AllocationBenchConfig,
        format_table,
        plot_results,
        run_allocation_bench,
        write_json,
    )

    cfg = validate_config(AllocationBenchConfig, dict(
        population=args.population, k=args.k, target_groups=args.target_groups, seeds=args.seeds,
        pool_size=args.pool_size, steps=args.steps, allocators=split_specs(args.allocators), sampler=args.sampler,
        epochs=args.epochs, drift=args.drift), what="bench allocation")
    report = run_allocation_bench(cfg)
    print(format_table(report))
    out = Path(args.out)
    json_path = Path(args.json_out) if args.json_out else out / "allocation.json"
    write_json(report, json_path)
    plot_path = plot_results(report, args.plot or json_path.with_suffix(".png"))
    print(f"\nJSON: {json_path}" + (f"   plot: {plot_path}" if plot_path else ""))
    return 0


def _generation(args: argparse.Namespace) -> int:
    from sara.bench.generation import (
        GenerationBenchConfig,
        format_table,
        parse_allocators,
        run_generation_bench,
        write_json,
    )

    specs = [spec + ("" if driver == "sync" else f"+{driver}") for spec, driver in parse_allocators(args.allocators)]
    cfg = validate_config(GenerationBenchConfig, dict(
        backend=args.backend, allocators=specs, task=args.task, groups=args.groups, k=args.k, steps=args.steps,
        seed=args.seed, seeds=args.seeds, reference=args.reference, slots=args.slots,
        max_new_tokens=args.max_new_tokens, carry_lag=args.carry_lag, complete_groups=args.complete_groups,
        task_stop=args.task_stop), what="bench generation")
    report = run_generation_bench(cfg, log=lambda line: print(f"[bench generation] {line}", file=sys.stderr,
                                                               flush=True))
    print(format_table(report))
    if args.json_out:
        print(f"\nJSON: {write_json(report, args.json_out)}")
    return 0


def _learner(args: argparse.Namespace) -> int:
    from sara.bench.learner import LearnerBenchConfig, format_table, run_learner_bench

    opts = dict(model=args.model, groups=args.groups, k=args.k, max_new_tokens=args.max_new_tokens, reps=args.reps,
                compute_dtype=args.compute_dtype, microbatch_tokens=args.microbatch_tokens, algo=args.algo,
                seed=args.seed)
    cfg = validate_config(LearnerBenchConfig, {**opts, **({"task": args.task} if args.task else {})},
                          what="bench learner")
    report = run_learner_bench(cfg, log=lambda line: print(f"[bench learner] {line}", file=sys.stderr, flush=True))
    print(format_table(report))
    if args.json_out:
        path = Path(args.json_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"\nJSON: {path}")
    return 0


def _decisions(args: argparse.Namespace) -> int:
    from sara.bench.decisions import run_decision_bench

    res = run_decision_bench(units=args.units, rounds=args.rounds, k=args.k, spec=args.allocator)
    print(json.dumps(res, indent=2))
    return 0
