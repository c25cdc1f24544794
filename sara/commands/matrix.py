"""``sara matrix``: every algorithm x allocator cell trained from the same policy and seed at the same rollout budget.

Each cell is a ``sara train`` run whose ``rollout_budget`` is what ``--steps`` steps of uniform allocation spend
(``steps x groups_per_step x k``), so allocators are compared at equal cost. Outputs in ``--out`` (default
``runs/matrix``): ``matrix.md`` (the table), ``matrix.png`` (held-out accuracy vs cumulative rollouts per cell),
``matrix.json`` and one directory per cell (``cells/<algo>-<allocator>/metrics.jsonl``). Cells run in parallel
processes, one per core by default.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

__all__ = ["register", "run", "run_matrix", "QUICK", "format_table", "sara_vs_ds"]

QUICK: dict[str, Any] = {
    "groups_per_step": 32,
    "optim": {"lr": 2e-4},
    "eval": {"num_prompts": 300, "samples": 2, "greedy": False},
}
"""Overrides of ``--quick`` (a CI-sized matrix: small batches, a higher learning rate, a smaller evaluation)."""


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


def _cell_name(algo: str, alloc: str) -> str:
    return f"{algo}-{alloc}".replace(":", "_").replace(",", "_").replace("=", "")


def _run_cell(cfg: dict[str, Any]) -> dict[str, Any]:
    """Worker: train one cell (in a fresh process) and return its summary + curve."""
    from sara.metrics import read_jsonl
    from sara.train import Trainer

    t0 = time.perf_counter()
    with Trainer(cfg) as trainer:
        summary = trainer.train()
    out = asdict(summary)
    out["wall_seconds"] = time.perf_counter() - t0
    out["curve"] = [{k: r[k] for k in ("step", "env/cum_rollouts", "eval/acc_sample", "eval/acc_greedy") if k in r}
                    for r in read_jsonl(Path(summary.out_dir) / "metrics.jsonl") if "eval/acc_sample" in r]
    return out


def run_matrix(base: Mapping[str, Any], algos: Sequence[str], allocators: Sequence[str], *, steps: int,
               out_dir: str | Path, workers: int | None = None, eval_every: int | None = None
               ) -> list[dict[str, Any]]:
    """Train every (algo, allocator) cell from ``base`` at the same rollout budget; write table, plot and JSON.

    Args:
        base: ``TrainConfig`` fields shared by every cell.
        algos: Algorithm specs (``sara.algos.ALGOS``).
        allocators: Allocator specs (``sara.allocators``).
        steps: Uniform-allocation steps defining the budget (``steps x groups_per_step x k`` rollouts), unless
            ``base`` sets ``rollout_budget``.
        out_dir: Output directory.
        workers: Parallel processes (default: one per core, at most one per cell).
        eval_every: Evaluate every this many steps (default: ``steps // 3``, so every curve has a few points).

    Returns:
        One dict per cell: ``RunSummary`` fields plus ``curve`` (eval records) and ``wall_seconds``.
    """
    from sara.config import validate_config
    from sara.envs.tasks import make_task
    from sara.metrics import plot_matrix
    from sara.policies import POLICIES
    from sara.train import TrainConfig, default_threads

    out = Path(out_dir)
    base_cfg = validate_config(TrainConfig, dict(base), what="matrix base config")
    budget = base_cfg.rollout_budget or steps * base_cfg.groups_per_step * base_cfg.k
    cores = default_threads()
    n_cells = len(algos) * len(allocators)
    workers = max(1, min(workers or cores, n_cells))
    threads = max(1, cores // workers)
    every = eval_every if eval_every is not None else max(1, steps // 3)
    cells = []
    for algo in algos:
        for alloc in allocators:
            cfg = base_cfg.model_copy(deep=True).model_dump()
            cfg.update(algo=algo, allocator=alloc, name=_cell_name(algo, alloc), rollout_budget=budget,
                       steps=2 * steps, out_dir=str(out / "cells" / _cell_name(algo, alloc)), threads=threads,
                       progress=False, tensorboard=False, checkpoint_every=0)
            cfg["eval"] = {**cfg["eval"], "every": every}
            cells.append(validate_config(TrainConfig, cfg, what=f"matrix cell {algo} x {alloc}").model_dump())
    # Warm-start (or load) the shared starting policy once, before the cells start in parallel.
    task = make_task(base_cfg.task)
    POLICIES.get(base_cfg.policy)(dict(base_cfg.policy_options), task=task, seed=base_cfg.seed, verbose=True)
    print(f"sara matrix: {n_cells} cells, budget {budget:,} rollouts each, {workers} worker(s) x {threads} "
          f"thread(s) -> {out}", flush=True)
    results: list[dict[str, Any]] = []
    if workers == 1:
        for cfg in cells:
            results.append(_run_cell(cfg))
            _report(results[-1])
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
            for res in pool.map(_run_cell, cells):
                results.append(res)
                _report(res)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.json").write_text(json.dumps(results, indent=1, default=float), encoding="utf-8")
    try:
        plot_matrix({f"{r['algo']}/{r['allocator']}": r["curve"] for r in results}, out / "matrix.png",
                    title=f"held-out accuracy vs rollouts (budget {budget:,} per cell)")
    except ImportError:  # matplotlib is optional
        pass
    return results


def _report(r: Mapping[str, Any]) -> None:
    print(f"  {r['algo']:>14} x {r['allocator']:<8} acc {r['acc_before']:.3f} -> {r['acc_after']:.3f}  "
          f"rollouts {r['rollouts']:,}  {r['wall_seconds']:.0f} s", flush=True)


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """The markdown table of a matrix run."""
    head = ("| algorithm | allocator | held-out acc (before → after) | Δ | steps | rollouts | tokens | "
            "effective fraction | wall s |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        eff = r["effective_groups"] / r["committed_groups"] if r["committed_groups"] else 0.0
        lines.append(f"| {r['algo']} | {r['allocator']} | {r['acc_before']:.3f} → {r['acc_after']:.3f} | "
                     f"{r['acc_after'] - r['acc_before']:+.3f} | {r['steps']} | {r['rollouts']:,} | {r['tokens']:,} | "
                     f"{eff:.2f} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines)


def sara_vs_ds(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """Per algorithm: rollouts SARA needed to first reach DS's final held-out accuracy, vs what DS spent."""
    notes = []
    by: dict[tuple[str, str], Mapping[str, Any]] = {}
    for r in results:  # the plain spec ("sara", "ds") wins over variants ("sara:prior=empirical"); else the first
        key = (r["algo"], str(r["allocator"]).split(":")[0])
        if key not in by or str(r["allocator"]) == key[1]:
            by[key] = r
    for (algo, alloc), ds in by.items():
        if alloc != "ds" or (algo, "sara") not in by:
            continue
        sara = by[(algo, "sara")]
        target = ds["acc_after"]
        reach = next((c["env/cum_rollouts"] for c in sara["curve"] if c.get("eval/acc_sample", -1) >= target), None)
        if reach is None:
            notes.append(f"- {algo}: SARA did not reach DS's final accuracy {target:.3f} within the budget "
                         f"(SARA final {sara['acc_after']:.3f}).")
        else:
            saved = 1.0 - reach / ds["rollouts"] if ds["rollouts"] else math.nan
            notes.append(f"- {algo}: SARA reached DS's final accuracy {target:.3f} after {reach:,.0f} rollouts vs "
                         f"DS's {ds['rollouts']:,} ({100 * saved:+.0f}% fewer).")
    return notes
