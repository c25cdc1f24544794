"""``sara bench``: ``allocation``, ``decisions`` and ``soak`` (simulation) here; ``generation``, ``stream``, ``ray``
and ``learner`` (engines) in ``sara.commands.bench_engines``.

Every bench prints a table on stdout and writes its JSON report where ``--json FILE`` says (``bench allocation``
also writes one by default, into ``--out DIR``, which it locks while it runs and never overwrites without
``--overwrite``); progress goes to stderr (``sara.commands.output``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sara.commands.counts import check_counts
from sara.commands.names import bench_allocation_out
from sara.commands.output import Ticker, claim_dir, kv_table, progress, write_report
from sara.config import validate_config
from sara.specs import split_specs

__all__ = ["register", "write_report"]


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: allocation, decisions, soak (simulator); generation, stream, "
                           "ray, learner (engines)")
    bsub = bench.add_subparsers(dest="bench", metavar="<benchmark>")

    p = bsub.add_parser("allocation", help="rollouts per effective group of allocators on a simulated prompt pool")
    p.add_argument("--population", default="u-shaped",
                   help="u-shaped | mid-training | uniform | beta:A,B | file:PATH (one success rate per line) | "
                        "features:informative|uninformative|misleading (prompts with band / size features)")
    p.add_argument("--k", type=int, default=8, help="group size")
    p.add_argument("--target-groups", type=int, default=512, help="committed groups per step")
    p.add_argument("--seeds", type=int, default=3, help="independent pools (seeds 0..N-1)")
    p.add_argument("--pool-size", type=int, default=20_000, help="prompts per simulated pool")
    p.add_argument("--steps", type=int, default=1, help="collection steps per seed")
    p.add_argument("--allocators", default="uniform;ds;sara",
                   help="allocator specs separated by ';' or ',' between specs (name:key=value,key=value)")
    p.add_argument("--sampler", default="uniform",
                   help="prompt sampler spec for every allocator (uniform | predictive[:key=value,...]); a spec may "
                        "carry its own as SPEC@SAMPLER; the reference DS samples uniformly unless written ds@SAMPLER; "
                        "SPEC@oracle is the floor (a sampler that knows the true success rates)")
    p.add_argument("--pool-epochs", type=float, default=None,
                   help="multi-step mode: run ceil(pool-epochs x pool-size / target-groups) steps over the same pool "
                        "(overrides --steps); reports starvation")
    p.add_argument("--drift", type=float, default=0.0,
                   help="per-step drift of success rates on the logit scale, larger for trained prompts (see "
                        "sara.bench.allocation.drift_rates)")
    p.add_argument("--json", dest="json_out", metavar="FILE", default=None,
                   help="write the JSON report here (default: DIR/allocation.json of --out)")
    p.add_argument("--plot", metavar="FILE", default=None, help="write the PNG plot here (default: beside the JSON)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="directory of the JSON report and plot when --json is not given (default: "
                        "runs/bench-allocation, followed by the --allocators, --population and --sampler that differ "
                        "from the defaults and a hash of the other options that do)")
    p.add_argument("--overwrite", action="store_true", help="replace a report already in --out")
    p.set_defaults(func=_allocation)

    d = bsub.add_parser("decisions", help="vectorized decision throughput of an allocator")
    d.add_argument("--units", type=int, default=1_000_000, help="open units decided on per call")
    d.add_argument("--rounds", type=int, default=4, help="rounds of dispatch + finished, timed together")
    d.add_argument("--k", type=int, default=8, help="group size")
    d.add_argument("--allocator", default="sara", help="allocator spec")
    d.add_argument("--json", dest="json_out", metavar="FILE", default=None, help="write the JSON report here")
    d.set_defaults(func=_decisions)

    s = bsub.add_parser("soak", help="many collection steps on the simulator with random budgets, targets, allocators, "
                        "driver modes and injected environment failures: exact accounting, bounded memory")
    s.add_argument("--steps", type=int, default=10_000, help="collection steps")
    s.add_argument("--seed", type=int, default=0, help="seed of the draws, the pool and the injected failures")
    s.add_argument("--k", type=int, default=8, help="group size")
    s.add_argument("--pool-size", type=int, default=20_000, help="prompts in the simulated pool")
    s.add_argument("--fault-rate", type=float, default=0.02, help="share of environment calls that raise")
    s.add_argument("--max-rss-growth-mb", type=float, default=64.0,
                   help="fail when resident memory grows more than this after the warm-up (a tenth of the steps)")
    s.add_argument("--json", dest="json_out", metavar="FILE", default=None, help="write the JSON report here")
    s.set_defaults(func=_soak)

    from sara.commands import bench_engines

    bench_engines.register(bsub)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)


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
        pool_epochs=args.pool_epochs, drift=args.drift), what="bench allocation")
    out = args.out or bench_allocation_out(args)
    lock = None if args.json_out else claim_dir(out, overwrite=args.overwrite, marker="allocation.json",
                                                 what="sara bench allocation",
                                                 replace=("allocation.json", "allocation.png"))
    json_path = Path(args.json_out) if lock is None else lock.directory / "allocation.json"
    try:  # --out stays locked until the report is written
        report = run_allocation_bench(cfg, log=lambda line: progress("bench allocation", line))
        print(format_table(report))
        write_json(report, json_path)
        plot_path = plot_results(report, args.plot or json_path.with_suffix(".png"))
    finally:
        if lock is not None:
            lock.release()
    print(f"\nJSON: {json_path}" + (f"   plot: {plot_path}" if plot_path else ""))
    return 0


def _decisions(args: argparse.Namespace) -> int:
    from sara.bench.decisions import run_decision_bench

    check_counts("bench decisions", args, ("units", "rounds", "k"))
    with Ticker("bench decisions"):
        res = run_decision_bench(units=args.units, rounds=args.rounds, k=args.k, spec=args.allocator)
    print(kv_table(res))
    write_report(res, args.json_out)
    return 0


def _soak(args: argparse.Namespace) -> int:
    from sara.bench.soak import soak
    from sara.config import ConfigError

    check_counts("bench soak", args, ("steps", "k", "pool_size", "seed"))
    if not 0.0 <= args.fault_rate < 1.0:
        raise ConfigError(f"bench soak: field 'fault_rate': {args.fault_rate}; give a share in [0, 1)")
    try:
        with Ticker("bench soak"):
            res = soak(args.steps, seed=args.seed, k=args.k, pool=args.pool_size, fault_rate=args.fault_rate,
                       max_rss_growth_mb=args.max_rss_growth_mb)
    except AssertionError as exc:
        print(f"sara: bench soak failed: {exc}", file=sys.stderr)
        return 1
    print(kv_table(res))
    write_report(res, args.json_out)
    return 0
