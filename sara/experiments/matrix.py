"""The algorithm x allocator matrix: every cell x seed a ``sara train`` run from the same policy at the same budget.

A cell is an algorithm and an ``ALLOCATOR[@SAMPLER]`` spec (``sara.experiments.cells``); every cell runs seeds
``base.seed .. base.seed + seeds - 1`` (``TrainConfig.seed``: rollouts, prompt order, mini-batch order and the
evaluation's samples; the starting weights are the same for every seed). ``run_matrix`` trains all runs in parallel
processes (``sara.experiments.matrix_runs``: stopped by SIGINT / SIGTERM with no result reported, resumed by a rerun)
and hands them to ``sara.experiments.matrix_report``, which measures them (``sara.experiments.curves``) and writes
``matrix.json``, ``matrix.md``, ``matrix.png``, ``matrix_seconds.png`` and ``matrix_tokens.png``. With a results store
(``sara.experiments.store``) the runs it holds are not trained again, each finished run is stored as it finishes, and
the report is the store's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sara.config import ConfigError
from sara.experiments.cells import Cell, parse_cells
from sara.experiments.matrix_runs import MatrixInterrupted, claim_plan, run_all, save_result
from sara.storage import atomic_write

__all__ = ["PHASE_KEYS", "run_matrix"]

PHASE_KEYS = ("collect_s", "learn_s", "rounds", "steps", "trained_groups", "banked_groups", "reward_var_x_groups")
"""A run's per-step sums (``result["phases"]``) behind the report's "where the seconds go" table: collection seconds;
learning seconds (advantages, update, weight sync); collection rounds; training steps; trained groups; groups left in
the bank after each step; and ``train/group_reward_var`` x trained groups."""


def _run_one(cfg: dict[str, Any], stopped: Callable[[], str | None] = lambda: None) -> dict[str, Any] | str:
    """Worker: train one run; its summary plus the columnar eval curve, also written to its ``result.json``; or
    the name of the signal that stopped it (unfinished: no ``result.json``).

    A run a signal stopped earlier continues from its checkpoint; one without a usable checkpoint starts over.
    ``curve["wall_s"]`` is training seconds (the sum of ``time/step``: collect, advantages, update, sync), without
    the time spent evaluating.
    """
    import shutil

    from sara.metrics import read_jsonl
    from sara.train import Trainer
    from sara.train.checkpoint import CheckpointError, list_checkpoints

    ckpts = Path(cfg["out_dir"]) / "checkpoints"
    try:
        trainer = Trainer(cfg, resume=bool(list_checkpoints(ckpts)))
    except CheckpointError:  # none of its checkpoints can be used: start over
        shutil.rmtree(ckpts, ignore_errors=True)
        trainer = Trainer(cfg)
    with trainer:
        if stopped() is not None:
            return str(stopped())
        summary = trainer.train()
    if summary.interrupted:
        return summary.interrupted
    out = asdict(summary)
    curve: dict[str, list[float]] = {"step": [], "rollouts": [], "tokens": [], "wall_s": [], "acc": [],
                                     "effective_groups": []}
    phases = dict.fromkeys(PHASE_KEYS, 0.0)
    wall = 0.0
    for r in read_jsonl(Path(summary.out_dir) / "metrics.jsonl"):
        wall += float(r.get("time/step") or 0.0)
        if "time/collect" in r:  # a training step (evaluation-only records have none)
            groups = float(r.get("train/batch_groups", 0.0))
            learn = sum(float(r.get(f"time/{p}", 0.0)) for p in ("advantages", "update", "sync"))
            for key, value in (("collect_s", r["time/collect"]), ("learn_s", learn), ("steps", 1.0),
                               ("rounds", r.get("alloc/rounds", 0.0)), ("trained_groups", groups),
                               ("banked_groups", r.get("train/banked_groups", 0.0)),
                               ("reward_var_x_groups", groups * float(r.get("train/group_reward_var", 0.0)))):
                phases[key] += float(value)
        if r.get("eval/acc_sample") is None:
            continue
        for key, value in (("step", r["step"]), ("rollouts", r.get("env/cum_rollouts", 0.0)),
                           ("tokens", r.get("env/cum_tokens", 0.0)), ("wall_s", wall), ("acc", r["eval/acc_sample"]),
                           ("effective_groups", r.get("env/cum_effective_groups", 0.0))):
            curve[key].append(float(value))
    out["curve"] = curve
    out["phases"] = phases
    out["seed"] = int(cfg["seed"])
    return save_result(cfg, out)


def run_matrix(base: Mapping[str, Any], cells: Sequence[Cell], *, steps: int, out_dir: str | Path, seeds: int = 1,
               workers: int | None = None, eval_every: int | None = None, reference: str = "ds",
               target_acc: float | None = None, command: str = "", store: str | Path | None = None,
               allow_mixed: bool = False) -> dict[str, Any]:
    """Train every cell for every seed from ``base`` at the same rollout budget; measure and write the outputs.

    Args:
        base: ``TrainConfig`` fields shared by every run.
        cells: From ``parse_cells``. The ``reference`` cell of each algorithm is added when missing (unless
            ``target_acc`` is given).
        steps: Uniform-allocation steps defining the budget (``steps x groups_per_step x k`` rollouts), unless
            ``base`` sets ``rollout_budget``. A run stops when its budget is spent (at most ``2 x steps`` steps).
        out_dir: Output directory (``matrix.json``, ``matrix.md``, ``matrix.png``, ``matrix_seconds.png``,
            ``matrix-plan.json``, ``cells/<name>/seed<s>/`` with each finished run's ``result.json``); the command
            holds its run lock.
        seeds: Seeds per cell (``base.seed + 0 .. seeds - 1``).
        workers: Parallel processes (default: one per core, at most one per run).
        eval_every: Evaluate every this many steps (default: ``steps // 3``, so every curve has a few points).
        reference: The allocator spec (``ALLOCATOR[@SAMPLER]``) whose mean final accuracy is the target and whose
            rollouts to it are the denominator of the ratios.
        target_acc: A fixed target accuracy instead of the reference's.
        command: The command line, written at the top of ``matrix.md``.
        store: A results store (``sara.experiments.store``): the planned runs it holds are not trained again, each
            run that finishes is stored there as it finishes, and the report is the store's (every run it holds).
        allow_mixed: Keep a store's runs of another config or sara version, reported apart (else refused).

    Returns:
        The report (``sara.experiments.matrix_report.analyze``), also written to ``matrix.json``.

    Raises:
        ConfigError: ``out_dir`` holds an unfinished matrix planned differently (``matrix_runs.claim_plan``), or
            ``store`` holds runs of another config or version (``ResultStore.claim``).
        MatrixInterrupted: a signal stopped it; ``matrix.md`` then lists the unfinished runs and nothing else.
    """
    from sara.config import validate_config
    from sara.envs.tasks import make_task
    from sara.experiments.matrix_report import analyze, write_outputs
    from sara.policies import POLICIES
    from sara.train import TrainConfig, default_threads

    t0 = time.perf_counter()  # the report's wall time: the whole matrix, the warm start included
    if seeds < 1:
        raise ConfigError(f"matrix: field 'seeds': must be >= 1 (got {seeds})")
    out = Path(out_dir)
    base_cfg = validate_config(TrainConfig, dict(base), what="matrix base config")
    budget = base_cfg.rollout_budget or steps * base_cfg.groups_per_step * base_cfg.k
    cells = list(cells)
    if target_acc is None:
        for algo in dict.fromkeys(c.algo for c in cells):
            if not any(c.algo == algo and c.spec == reference for c in cells):
                (ref,) = parse_cells([algo], [reference])
                names = {c.name for c in cells}
                cells.append(Cell(ref.algo, ref.allocator, ref.sampler, ref.spec,
                                  ref.name if ref.name not in names else f"{ref.name}-ref"))
                print(f"sara matrix: added the reference cell {algo} x {reference} (the target and the ratios' "
                      "denominator; --target-acc X fixes the target instead)", flush=True)
    seed_list = [base_cfg.seed + i for i in range(seeds)]
    cores = default_threads()
    asked, n_runs = workers, len(cells) * seeds
    workers = max(1, min(workers or cores, n_runs))
    threads = max(1, cores // workers)
    every = eval_every if eval_every is not None else max(1, steps // 3)
    runs: list[tuple[Cell, dict[str, Any]]] = []
    for cell in cells:
        for seed in seed_list:
            cfg = base_cfg.model_copy(deep=True).model_dump()
            cfg.update(algo=cell.algo, allocator=cell.allocator, name=f"{cell.name}-seed{seed}", seed=seed,
                       rollout_budget=budget, steps=2 * steps, out_dir=str(out / "cells" / cell.name / f"seed{seed}"),
                       threads=threads, progress=False, tensorboard=False, checkpoint_every=0)
            if cell.sampler is not None:
                cfg["sampler"] = cell.sampler
            cfg["eval"] = {**cfg["eval"], "every": every}
            runs.append((cell, validate_config(TrainConfig, cfg, what=f"matrix cell {cell.algo} x {cell.spec}"
                                               ).model_dump()))
    # Warm-start (or load) the shared starting policy once, before the runs start in parallel. The tiny policy's
    # weights depend on its options only (init_seed, warm_start.seed), never on TrainConfig.seed: every seed starts
    # from the same weights, and seeds vary rollouts, prompt order and mini-batch order.
    task = make_task(base_cfg.task)
    if not task.eval_prompts:
        raise ConfigError(f"matrix: field 'task': {base_cfg.task!r} has no held-out prompts, and sara matrix measures "
                          "held-out accuracy; hold some out with the task option eval_size=N")
    eval_prompts = min(base_cfg.eval.num_prompts, len(task.eval_prompts))
    kept, todo, on_result = _use_store(store, runs, base_cfg.sampler, allow_mixed, eval_prompts)
    if kept:  # the workers and their threads by the runs left to train
        workers = max(1, min(asked or cores, len(todo)))
        threads = max(1, cores // workers)
        for i in todo:
            runs[i][1]["threads"] = threads
    policy_name, policy_options = base_cfg.component("policy")
    POLICIES.get(policy_name)(policy_options, task=task, seed=base_cfg.seed, verbose=True)
    earlier = claim_plan(out, [(cell.name, cfg["seed"], cfg) for cell, cfg in runs])
    print(f"sara matrix: {len(cells)} cells x {seeds} seed(s), budget {budget:,} rollouts each, {workers} worker(s) "
          f"x {threads} thread(s) -> {out}" + (f"; {earlier} run(s) finished earlier are kept" if earlier else "")
          + (f"; {len(kept)} run(s) stored in {store} are not run again" if kept else ""), flush=True)
    labels = [f"{runs[i][0].name} seed {runs[i][1]['seed']}" for i in todo]
    try:
        done = run_all(_run_one, [runs[i][1] for i in todo], workers=workers, labels=labels,
                       on_result=lambda j, res: on_result(todo[j], res))
    except MatrixInterrupted as exc:  # no results: a status page names the unfinished runs
        page = (f"# Unfinished matrix\n\n`{command or 'sara matrix'}` was {exc}.\n\n"
                "Unfinished runs (no results):\n\n" + "".join(f"- {u}\n" for u in exc.unfinished))
        atomic_write(out / "matrix.md", lambda fh: fh.write(page.encode("utf-8")))
        raise
    if store is not None:
        from sara.experiments.store import config_hash, sara_version, store_report, store_view

        main = (config_hash(store_view(runs[0][1], base_cfg.sampler)), sara_version())
        report = store_report(store, reference=reference, target_acc=target_acc, main=main,
                              order=list(dict.fromkeys(cell.name for cell in cells)))
    else:
        results = dict(zip(todo, done))
        report = analyze([(cell, results[i]) for i, (cell, _) in enumerate(runs)], budget=budget,
                         reference=reference, target_acc=target_acc, eval_prompts=eval_prompts,
                         eval_samples=base_cfg.eval.samples)
    report["command"] = command
    report["wall_seconds"] = time.perf_counter() - t0
    write_outputs(report, out)
    return report


def _use_store(store: str | Path | None, runs: list[tuple[Cell, dict[str, Any]]], base_sampler: str,
               allow_mixed: bool, eval_prompts: int) -> tuple[dict[int, Any], list[int], Callable[[int, Any], None]]:
    """The runs ``store`` holds (not trained again), the indices of the others, and what to do as each finishes
    (print it; with a store, store it too)."""
    if store is None:
        return {}, list(range(len(runs))), lambda i, res: _report(runs[i][0], res)
    from sara.experiments.store import ResultStore

    rs = ResultStore(store, create=True)
    kept = rs.claim(runs, base_sampler=base_sampler, allow_mixed=allow_mixed)

    def on_result(i: int, res: dict[str, Any]) -> None:
        rs.save(runs[i][0], runs[i][1], res, base_sampler=base_sampler, eval_prompts=eval_prompts)
        _report(runs[i][0], res)

    return kept, [i for i in range(len(runs)) if i not in kept], on_result


def _report(cell: Cell, r: Mapping[str, Any]) -> None:
    print(f"  {cell.algo:>14} x {cell.spec:<24} seed {r['seed']}  acc {r['acc_before']:.3f} -> {r['acc_after']:.3f}"
          f"  rollouts {r['rollouts']:,}  {r['wall_seconds']:.0f} s", flush=True)
