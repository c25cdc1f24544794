"""``sara matrix``: every algorithm x allocator cell, over seeds, trained from the same policy at the same rollout budget.

Cells are ``--algos`` x ``--allocators``, both ``;``-separated specs; an allocator may carry its own prompt sampler as
``ALLOCATOR@SAMPLER``, e.g. ``--allocators "ds;sara;sara:prior=history,decay=0.95@predictive"``. Every cell runs
``--seeds N`` seeds (rollouts and prompt order differ, the starting weights do not) at a rollout budget of what
``--steps`` steps of uniform allocation spend (``steps x groups_per_step x k``). Per cell, mean and 95% t-interval
over seeds of: held-out accuracy at 25/50/75% of the budget and at the end, the area under accuracy vs rollouts, and
the rollouts, tokens and training seconds to first reach the target accuracy (default: the ``--reference`` cell's
final accuracy, ``ds``; ``--target-acc`` fixes it), with the ratio to the reference. Outputs in ``--out`` (default
``runs/matrix``, ``runs/matrix-quick`` with ``--quick``, followed by the options that differ from the defaults,
``sara.commands.names``; ``--json FILE`` writes the report there too): ``matrix.md``, ``matrix.json`` (per-seed and
aggregate), ``matrix.png``, ``matrix_seconds.png`` and ``matrix_tokens.png`` (mean curve and min-max band per cell
against rollouts, training seconds and generated tokens) and ``cells/<cell>/seed<s>/metrics.jsonl``. Runs go in parallel processes, one per core by
default.

``--out`` is locked while the matrix runs (a second matrix there is refused). Ctrl-C or SIGTERM stops it within
seconds (worker processes included) and reports no result: ``matrix.md`` lists the unfinished runs, and the same
command run again keeps the finished runs and trains the others (another matrix on that ``--out`` is refused unless
``--overwrite``).

``--store results/<name>`` keeps each finished cell x seed as small text files there, meant to be committed
(``sara.experiments.store``: its config, config hash, sara version, machine, summary, eval curve and metrics; no
checkpoints, which stay in ``--out``, a scratch directory then). The same command run anywhere a copy of those files
is (a fresh clone, another machine) runs only the cell-seeds the store lacks, and the report pools every seed the
store holds, saying per cell which machines ran how many. A store holding runs of another config or sara version is
refused, naming the first differing field; ``--allow-mixed`` keeps them as cells of their own, never pooled.
``--report results/<name>`` prints the report from the store's files alone (no runs).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from sara.commands.counts import MAX_RUNS, check_counts
from sara.commands.names import matrix_out
from sara.commands.output import Ticker, claim_dir, remove_entries, write_report
from sara.experiments.cells import parse_cells
from sara.experiments.matrix import run_matrix
from sara.experiments.matrix_report import format_report
from sara.experiments.matrix_runs import PLAN_NAME, MatrixInterrupted, runs_in_progress

__all__ = ["register", "run", "run_matrix", "QUICK", "format_report", "parse_cells"]

QUICK: dict[str, Any] = {
    "task": "sara/Arithmetic-v0:max_digits=2,ops=+,pool_size=5000",
    "groups_per_step": 32,
    "optim": {"lr": 2e-4},
    "eval": {"num_prompts": 300, "samples": 2, "greedy": False},
    "policy_options": {"warm_start": {"steps": 1500, "target_loss": 0.25}},
}
"""Overrides of ``--quick`` (a CI-sized matrix: small batches, a higher learning rate, a smaller evaluation, and a
warm start to a mean loss of 0.25 so the tiny policy starts mid-way (about 60% held-out accuracy) with room to learn
in the small budget; near 95% two steps of DS move accuracy by less than the evaluation's noise, near 10% the budget
moves it by less). A loss target, not a step count: 400 steps started at 60% on one machine and at 8% on another.
The task is pinned to the one these numbers were measured on (``sara train``'s default pool is a mixture, see
docs/tasks.md)."""


PROGRESS_EVERY_S = 60.0
"""Seconds between ``sara matrix``'s "running" lines on stderr."""

MATRIX_FILES = ("matrix.json", "matrix.md", "matrix.png", "matrix_seconds.png", "matrix_tokens.png", PLAN_NAME,
                "cells")
"""What a matrix writes in ``--out`` (``--overwrite`` removes these first)."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "matrix", help="algorithm x allocator matrix over seeds at equal rollout budget",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default="grpo;rloo;ppo;reinforce_pp", metavar="SPECS",
                   help="';'-separated algorithm specs")
    p.add_argument("--allocators", default="uniform;ds;sara", metavar="SPECS",
                   help="';'-separated ALLOCATOR[@SAMPLER] specs, e.g. 'ds;sara;sara:prior=history@predictive'")
    p.add_argument("--seeds", type=int, default=1, metavar="N", help="seeds per cell (seed .. seed+N-1)")
    p.add_argument("--reference", default="ds", metavar="SPEC",
                   help="the cell (ALLOCATOR[@SAMPLER]) whose final accuracy is the target and the ratios' "
                        "denominator; added when missing")
    p.add_argument("--target-acc", type=float, default=None, metavar="X",
                   help="fixed target accuracy instead of the reference's final accuracy")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="uniform-allocation steps that define the rollout budget (default: 20, --quick 6)")
    p.add_argument("--quick", action="store_true", help="a tiny CI-sized matrix")
    p.add_argument("--config", metavar="FILE", help="base TrainConfig (YAML/JSON) shared by every cell")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="override a base config field (repeatable)")
    p.add_argument("--driver", choices=("sync", "stream"), default=None,
                   help="collection driver of every cell (TrainConfig.driver; default: the config's, sync)")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="parallel runs (default: one per core)")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="output directory (default: runs/matrix, --quick runs/matrix-quick, followed by the options "
                        "that differ from the defaults: --algos, --allocators, --seeds, and a hash of the others)")
    p.add_argument("--json", dest="json_out", metavar="FILE", default=None,
                   help="also write the report (what matrix.json holds) to FILE")
    p.add_argument("--overwrite", action="store_true", help="replace a previous matrix in the output directory")
    p.add_argument("--store", metavar="DIR", default=None,
                   help="results store to commit, e.g. results/<name>: each finished run's small text files go "
                        "there (no checkpoints); runs it holds are not run again, and the report pools all it holds")
    p.add_argument("--allow-mixed", action="store_true",
                   help="with --store: keep its runs of another config or sara version, reported as cells apart "
                        "(never pooled), instead of refusing")
    p.add_argument("--report", metavar="DIR", default=None,
                   help="print the report of the results store DIR from its files alone (no runs); with "
                        "--reference, --target-acc, --json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sara.config import ConfigError
    from sara.train import apply_overrides, load_config

    check_counts("matrix", args, ("steps", "seeds", "workers"))
    if args.target_acc is not None and not 0.0 <= args.target_acc <= 1.0:
        raise ConfigError(f"matrix: field 'target_acc': must be an accuracy in [0, 1] (got {args.target_acc})")
    cells = parse_cells(args.algos, args.allocators)
    if len(cells) * args.seeds > MAX_RUNS:
        raise ConfigError(f"matrix: {len(cells)} cells x {args.seeds} seeds = {len(cells) * args.seeds:,} runs, more "
                          f"than {MAX_RUNS:,}; give fewer --algos, --allocators or --seeds")
    reference = args.reference.strip()
    if not reference or ";" in reference:
        raise ConfigError(f"matrix: field 'reference': one ALLOCATOR[@SAMPLER] spec, e.g. ds (got {reference!r})")
    parse_cells(["grpo"], [reference])  # the ALLOCATOR[@SAMPLER] form
    if args.report:
        return _print_store(args, reference)
    if args.allow_mixed and not args.store:
        raise ConfigError("matrix: --allow-mixed applies to a results store; add --store DIR")
    steps = args.steps or (6 if args.quick else 20)
    base = load_config(args.config, [], base=apply_overrides(QUICK, []) if args.quick else None)
    if args.driver:
        args.overrides = [f"driver.barrier={str(args.driver == 'sync').lower()}", *args.overrides]
    base = load_config(None, args.overrides, base=base.model_dump())
    # The run lock first: nothing in --out is removed while another matrix holds it.
    out_dir = args.out or matrix_out(args)
    if args.store and Path(out_dir).resolve().is_relative_to(Path(args.store).resolve()):
        raise ConfigError(f"matrix: --out {out_dir} lies inside --store {args.store}, which holds small files "
                          "only; give --out a directory outside it (default: under runs/)")
    # With a store, --out is scratch: a finished matrix there is replaced (its results are in the store).
    lock = claim_dir(out_dir, overwrite=args.overwrite or bool(args.store),
                     marker="matrix.json", what="sara matrix", replace=MATRIX_FILES)
    out = lock.directory
    try:
        if args.overwrite:  # an unfinished matrix too (no matrix.json yet)
            remove_entries(out, MATRIX_FILES)
        every = base.eval.every if any(o.strip().startswith("eval.every") for o in args.overrides) else None
        # a "running" line between the finished runs' lines, with the step each running run has reached
        with Ticker("sara matrix", every=PROGRESS_EVERY_S, detail=lambda: runs_in_progress(out)):
            report = run_matrix(base.model_dump(), cells, steps=steps, out_dir=out, seeds=args.seeds,
                                workers=args.workers, eval_every=every, reference=reference,
                                target_acc=args.target_acc, command="sara matrix " + " ".join(_argv(args)),
                                store=args.store, allow_mixed=args.allow_mixed)
    except MatrixInterrupted as exc:
        print(f"sara matrix: {exc} (unfinished: {', '.join(exc.unfinished)})", file=sys.stderr, flush=True)
        return 128 + int(signal.Signals[exc.signal_name])
    finally:
        lock.release()
    print(format_report(report))
    print(f"wrote {out / 'matrix.md'}, {out / 'matrix.png'} (and _seconds, _tokens), {out / 'matrix.json'}")
    if args.json_out:
        write_report(report, args.json_out)
    return 0


def _print_store(args: argparse.Namespace, reference: str) -> int:
    """``--report DIR``: the report of a results store, from its files alone."""
    from sara.experiments.store import store_report

    report = store_report(args.report, reference=reference, target_acc=args.target_acc)
    print(format_report(report))
    if args.json_out:
        write_report(report, args.json_out)
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    parts = [f'--algos "{args.algos}"', f'--allocators "{args.allocators}"']
    if args.seeds != 1:
        parts.append(f"--seeds {args.seeds}")
    if args.reference != "ds":
        parts.append(f'--reference "{args.reference}"')
    if args.target_acc is not None:
        parts.append(f"--target-acc {args.target_acc}")
    if args.steps is not None:
        parts.append(f"--steps {args.steps}")
    if args.quick:
        parts.append("--quick")
    if args.config:
        parts.append(f"--config {args.config}")
    parts += [f"--set {o}" for o in args.overrides]
    if args.store:
        parts.append(f"--store {args.store}" + (" --allow-mixed" if args.allow_mixed else ""))
    return parts
