"""``sara matrix``: every algorithm x allocator cell trained from the same policy and seed at the same rollout budget.

Each cell is a ``sara train`` run whose ``rollout_budget`` is what ``--steps`` steps of uniform allocation spend
(``steps x groups_per_step x k``), so allocators are compared at equal cost. Outputs in ``--out`` (default
``runs/matrix``): ``matrix.md`` (the table), ``matrix.png`` (held-out accuracy vs cumulative rollouts per cell),
``matrix.json`` and one directory per cell (``cells/<algo>-<allocator>/metrics.jsonl``). Cells run in parallel
processes, one per core by default.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from sara.bench.matrix import format_table, run_matrix, sara_vs_ds

__all__ = ["register", "run", "run_matrix", "QUICK", "format_table", "sara_vs_ds"]

QUICK: dict[str, Any] = {
    "groups_per_step": 32,
    "optim": {"lr": 2e-4},
    "eval": {"num_prompts": 300, "samples": 2, "greedy": False},
    "policy_options": {"warm_start": {"steps": 400}},
}
"""Overrides of ``--quick`` (a CI-sized matrix: small batches, a higher learning rate, a smaller evaluation, and a
shorter warm start so the tiny policy starts mid-way (about 60% held-out accuracy) with room to learn in the small
budget; the default 600-step warm start starts near 95%, where two steps of DS move accuracy by less than the
evaluation's noise)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "matrix", help="algorithm x allocator compatibility matrix at equal rollout budget",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default="grpo,rloo,ppo,reinforce_pp", help="comma-separated algorithm specs")
    p.add_argument("--allocators", default="uniform,ds,sara", help="comma-separated allocator specs")
    p.add_argument("--steps", type=int, default=None,
                   help="uniform-allocation steps that define the rollout budget (default 20, --quick 6)")
    p.add_argument("--quick", action="store_true", help="a tiny CI-sized matrix")
    p.add_argument("--config", metavar="FILE", help="base TrainConfig (YAML/JSON) shared by every cell")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="override a base config field (repeatable)")
    p.add_argument("--workers", type=int, default=None, help="parallel cells (default: one per core)")
    p.add_argument("--out", metavar="DIR", default=None, help="output directory (default runs/matrix)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sara.config import ConfigError
    from sara.train import apply_overrides, load_config

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"matrix: field 'steps': must be >= 1 (got {args.steps})")
    steps = args.steps or (6 if args.quick else 20)
    base = load_config(args.config, [], base=apply_overrides(QUICK, []) if args.quick else None)
    base = load_config(None, args.overrides, base=base.model_dump())
    out = Path(args.out or ("runs/matrix-quick" if args.quick else "runs/matrix"))
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    allocs = [a.strip() for a in args.allocators.split(",") if a.strip()]
    t0 = time.perf_counter()
    every = base.eval.every if any(o.strip().startswith("eval.every") for o in args.overrides) else None
    results = run_matrix(base.model_dump(), algos, allocs, steps=steps, out_dir=out, workers=args.workers,
                         eval_every=every)
    table = format_table(results)
    notes = sara_vs_ds(results)
    cmd = "sara matrix " + " ".join(_argv(args))
    text = f"`{cmd}` ({time.perf_counter() - t0:.0f} s wall)\n\n{table}\n" + ("\n" + "\n".join(notes) + "\n" if notes else "")
    (out / "matrix.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {out / 'matrix.md'}, {out / 'matrix.png'}, {out / 'matrix.json'}")
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    parts = [f"--algos {args.algos}", f"--allocators {args.allocators}"]
    if args.steps is not None:
        parts.append(f"--steps {args.steps}")
    if args.quick:
        parts.append("--quick")
    if args.config:
        parts.append(f"--config {args.config}")
    parts += [f"--set {o}" for o in args.overrides]
    return parts
