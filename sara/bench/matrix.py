"""The algorithm x allocator matrix: every cell a ``sara train`` run from the same policy and seed, at the same budget.

``run_matrix`` trains the cells (in parallel processes), writes ``matrix.json`` and ``matrix.png``; ``format_table``
and ``sara_vs_ds`` turn the results into the markdown table and notes of ``sara matrix`` (``sara.commands.matrix``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sara.bench.summary import group_ratios

__all__ = ["format_table", "run_matrix", "sara_vs_ds"]


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
    policy_name, policy_options = base_cfg.component("policy")
    POLICIES.get(policy_name)(policy_options, task=task, seed=base_cfg.seed, verbose=True)
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
        eff = group_ratios([r])["effective_fraction"]
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
