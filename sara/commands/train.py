"""``sara train``: train a policy with an RL algorithm and a rollout allocator; print what it learned and saved.

With no arguments it runs the embedded default (``TrainConfig()``): GRPO + SARA on the tiny transformer policy and
the mixture of arithmetic bands (``sara/Mixture-v0:components=arithmetic-bands``), about 40 s on 2 CPU cores once
the policy's supervised warm start is cached (the first run also computes it).

Outputs go to ``--out DIR`` (default ``runs/<name>``, a name that carries what differs between runs: algorithm,
allocator, sampler, task, seed; ``sara.commands.names``): ``metrics.jsonl`` (one record per step),
``learning_curve.png``, ``checkpoints/`` when ``checkpoint_every`` is set (or a signal stops the run) and ``tb/``
(TensorBoard) when the ``tensorboard`` extra is installed; the summary lists every file written, and ``--json FILE``
writes it as JSON. A directory that already holds a run is refused unless ``--overwrite`` (replace it) or
``--resume`` (continue it); the run lock is taken before either, so a directory another run holds is refused with
nothing in it touched. ``--resume`` of a directory without a run, or of a run without a usable checkpoint, is refused
and keeps its files.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

__all__ = ["register", "run", "format_summary"]


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "train", help="train a policy (default: GRPO + SARA, tiny policy, arithmetic) and summarize",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE", help="YAML/JSON file of TrainConfig fields")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                   help="override a TrainConfig field, e.g. --set algo=rloo --set optim.lr=1e-4 (repeatable); "
                        "every key and its value: sara train --print-config; what each means: docs/training.md")
    p.add_argument("--out", metavar="DIR", help="output directory, taken literally (default: runs/<name>, the "
                   "config's name or one made of the algorithm, allocator, sampler, task and seed)")
    p.add_argument("--json", dest="json_out", metavar="FILE", help="also write the summary as JSON to FILE")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a previous run in the output directory (its metrics, plot, checkpoints, tb/)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output dir")
    p.add_argument("--quiet", action="store_true", help="no progress bar (config: progress)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--ray", action="store_true", help="generate on Ray actors, one backend copy each (docs/ray.md)")
    p.add_argument("--num-workers", type=int, metavar="N", help="Ray actors (with --ray; config: ray.num_workers)")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="join this Ray cluster ('auto', 'ray://host:10001'; default: start a local one)")
    p.add_argument("--driver", choices=("sync", "stream"),
                   help="collection driver: synchronous rounds or streaming (docs/streaming.md; config: driver)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    started = time.perf_counter()  # the whole command: imports, warm start, evaluations
    from sara.commands.names import train_run_name
    from sara.train import Trainer, default_threads, load_config

    overrides = []  # the flags first, so a --set of the same section refines them (--driver stream --set driver.slots=8)
    if args.driver:
        overrides.append(f"driver.barrier={str(args.driver == 'sync').lower()}")
    if args.ray:
        overrides.append("ray.enabled=true")
    if args.num_workers is not None:
        overrides.append(f"ray.num_workers={args.num_workers}")
    if args.ray_address:
        overrides.append(f"ray.address={args.ray_address}")
    overrides += args.overrides
    if args.quiet:
        overrides.append("progress=false")
    cfg = load_config(args.config, overrides, values={} if args.out is None else {"out_dir": args.out})
    if args.out is None and cfg.out_dir is None:  # runs/<name>, a name that carries what differs
        cfg = cfg.model_copy(update={"name": train_run_name(cfg, overrides)})
    from sara.train.dtypes import dtype_lines, run_dtypes, run_kv_cache, run_microbatch
    from sara.train.microbatch import microbatch_line

    dtypes = run_dtypes(cfg)  # what ``auto`` resolves to here (sara.machine), before anything is built
    if args.print_config:
        from sara.train.resolve import config_yaml

        print(config_yaml(cfg))  # the resolved allocator and sampler as comments; no ray section while it is off
        kv = run_kv_cache(cfg)
        print("\n".join(f"# {line}" for line in ["dtypes on this machine (auto: bfloat16 where it is native):",
                                                  *dtype_lines(dtypes), microbatch_line(*run_microbatch(cfg)),
                                                  *([kv] if kv else [])]))
        return 0
    if cfg.threads is None:
        cfg = cfg.model_copy(update={"threads": default_threads()})
    from sara.commands.output import claim_dir
    from sara.config import ConfigError
    from sara.train.rundir import RUN_FILES

    if args.resume and args.overwrite:
        raise ConfigError("sara train: give --resume (continue the run in --out) or --overwrite (replace it), not both")
    # The run lock first: --overwrite removes a previous run only when no live run holds the directory.
    lock = claim_dir(cfg.output_dir, overwrite=args.overwrite, marker="metrics.jsonl", what="sara train",
                     replace=RUN_FILES, resume_hint=True, resume=args.resume, field="out_dir", config="train config")
    try:
        print(f"sara train: {run_label(cfg.algo, cfg.allocator, cfg.sampler)} on {cfg.task} ({cfg.policy} policy, "
              f"{cfg.backend} backend), "
              f"{cfg.steps} steps x {cfg.groups_per_step} groups of k={cfg.k} -> {cfg.output_dir}", flush=True)
        print("\n".join(dtype_lines(dtypes)), flush=True)
        with Trainer(cfg, resume=args.resume, verbose=True, run_lock=lock) as trainer:
            summary = trainer.train()
    finally:
        lock.release()
    seconds = time.perf_counter() - started
    rates = floor_rates(summary, cfg, {role: choice.name for role, choice in dtypes.items()})
    print(format_summary(summary, k=cfg.k, sampler=cfg.sampler, command_seconds=seconds, rates=rates))
    if args.json_out:
        from sara.commands.output import write_report

        write_report(summary_report(summary, cfg, seconds, rates), args.json_out,
                     kept=f"the run is complete in {cfg.output_dir}" + (f" (checkpoint {summary.checkpoint})"
                                                                         if summary.checkpoint else ""))
    if summary.interrupted:
        import signal

        where = f"checkpoint {summary.checkpoint} written" if summary.checkpoint else "no checkpoint could be written"
        print(f"sara train: stopped by {summary.interrupted} after step {summary.steps}; {where}; continue with "
              "--resume", file=sys.stderr, flush=True)
        return 128 + int(signal.Signals[summary.interrupted])
    return 0


def _pct(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def run_label(algo: str, allocator: str, sampler: str = "uniform") -> str:
    """``algo + allocator[@sampler]``: what a run trains with, the sampler named unless it is uniform."""
    return f"{algo} + {allocator}" + ("" if sampler.strip() == "uniform" else f"@{sampler}")


def floor_rates(s: Any, cfg: Any, dtypes: dict[str, str]) -> dict[str, float] | None:
    """This CPU's matmul rate per part of ``s.flop_floor`` (``sara.train.flops.part_rates``, a few seconds); None when
    the floor is unknown or the policy computes on another device."""
    from sara.train.flops import part_rates

    device = str(cfg.component("policy")[1].get("device", "cpu"))
    return part_rates(dtypes) if s.flop_floor and device.startswith("cpu") else None


def summary_report(s: Any, cfg: Any, command_seconds: float, rates: dict[str, float] | None = None) -> dict[str, Any]:
    """``sara train --json``: the ``RunSummary`` fields, ``rollouts_per_effective_group``, ``command_seconds``, the
    FLOP floor's seconds at this CPU's matmul rates (``flop_floor_seconds``, ``matmul_gflops`` by part: ``rates``;
    null without) and the resolved config (non-finite numbers as null; the DS estimates null under a non-uniform
    sampler)."""
    import dataclasses

    from sara.metrics import ds_estimate_applies
    from sara.train.flops import floor_seconds

    def finite(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [finite(x) for x in v]
        return v

    report = dataclasses.asdict(s)
    if not ds_estimate_applies(cfg.sampler):  # the estimate undercounts DS under a selective sampler
        report.update(ds_rollouts_estimate=None, ds_tokens_estimate=None)
    report.update(flop_floor_seconds=floor_seconds(s.flop_floor, rates) if rates else None, matmul_gflops=rates)
    report.update(sampler=cfg.sampler, effective_fraction=s.effective_fraction, command_seconds=command_seconds,
                  rollouts_per_effective_group=s.rollouts / s.effective_groups if s.effective_groups else None,
                  config=cfg.model_dump(mode="json"))
    return finite(report)


def _fates(s: Any) -> str:
    """``tokens (committed / abandoned / discarded)``, plus the aborted rollouts' tokens when there are any."""
    f = s.tokens_by_fate
    text = f"{s.tokens:,} ({f['committed']:,} / {f['abandoned']:,} / {f['discarded']:,})"
    return text + (f"; {f['aborted']:,} more in aborted rollouts" if f["aborted"] else "")


def format_summary(s: Any, *, k: int, sampler: str = "uniform", command_seconds: float | None = None,
                   rates: dict[str, float] | None = None) -> str:
    """A markdown table of a ``RunSummary`` (``sampler``: the run's, named in the header, and the 'DS would have
    spent' rows only when it is uniform, ``sara.metrics.ds_estimate_applies``; ``command_seconds``: the whole
    command's wall time, shown beside the training's; ``rates``: this CPU's matmul GFLOP/s per part of the FLOP
    floor, which is then shown in seconds beside the run's)."""
    from sara.metrics import ds_estimate_applies
    from sara.train.flops import floor_seconds

    saved = s.ds_rollouts_estimate - s.rollouts
    rows = [
        ("held-out accuracy (sampled, T=train)", f"{_pct(s.acc_before)} -> {_pct(s.acc_after)}"),
        ("held-out accuracy (greedy)", f"{_pct(s.greedy_before)} -> {_pct(s.greedy_after)}"),
    ]
    if s.acc_by_band:
        rows.append(("held-out accuracy per band (eval.by)",
                     ", ".join(f"{label}: {_pct(b)} -> {_pct(a)}" for label, (b, a) in s.acc_by_band.items())))
    rows += [
        ("training steps", f"{s.steps}"),
        ("rollouts spent", f"{s.rollouts:,}"),
        ("tokens generated (committed / abandoned / discarded)", _fates(s)),
        ("prompt (prefill) tokens / trained completion tokens", f"{s.prompt_tokens:,} / {s.trained_tokens:,}"),
        ("effective-group fraction of the batch", f"{_pct(s.effective_fraction)} "
                                                  f"({s.effective_groups:,} of {s.committed_groups:,} groups)"),
        ("rollouts per effective group (k = " + str(k) + " is the floor)",
         f"{s.rollouts / s.effective_groups:.1f}" if s.effective_groups else "n/a"),
        ("P(mixed) of a fresh prompt (estimated)", _pct(s.p_mixed)),
        ("verifier errors / timeouts (rollouts scored 0)", f"{s.verifier_errors:,} / {s.verifier_timeouts:,}"),
        ("peak resident memory", f"{s.peak_rss_mb / 1024:.2f} GiB"),
    ]
    if not ds_estimate_applies(sampler):
        rows.append(("DS would have spent (est.)", f"n/a with the {sampler.split(':')[0]} sampler (its draws overstate "
                     "P(mixed)); run --set allocator=ds --set sampler=uniform to compare"))
    elif not math.isnan(s.ds_rollouts_estimate) and s.ds_rollouts_estimate > 0:  # 0 when no group was effective
        rows += [
            ("DS would have spent (est.: k / P(mixed) per effective group)", f"{s.ds_rollouts_estimate:,.0f}"),
            ("rollouts saved vs DS (est.)", f"{saved:,.0f} ({_pct(saved / s.ds_rollouts_estimate)})"),
        ]
        ds_tok = s.ds_tokens_estimate
        if not math.isnan(ds_tok) and ds_tok > 0:
            rows.append(("tokens saved vs DS (est., same tokens per rollout)",
                         f"{ds_tok - s.tokens:,.0f} ({_pct((ds_tok - s.tokens) / ds_tok)})"))
    if s.seconds_by_phase:
        rows.append(("training seconds by phase", ", ".join(f"{p} {v:.1f}" for p, v in s.seconds_by_phase.items())))
    if s.flop_floor:
        parts = " / ".join(f"{part} {f / 1e12:,.1f}" for part, f in s.flop_floor.items())
        floor = f"{sum(s.flop_floor.values()) / 1e12:,.1f} TFLOP ({parts})"
        if rates:
            at = floor_seconds(s.flop_floor, rates)
            floor += (f" = {at:.0f} s at this CPU's matmul rate (" + ", ".join(f"{p} {r:.0f}" for p, r in rates.items())
                      + f" GFLOP/s); the run took {s.wall_seconds / at:.1f}x that")
        rows.append(("FLOP floor of the run's work (sara.train.flops)", floor))
    wall = f"{s.wall_seconds:.0f} s"
    if command_seconds is not None:
        wall = f"{command_seconds:.0f} s, the whole command ({wall} in training steps and evaluations)"
    rows += [("wall time", wall),
             ("files written", f"{s.out_dir}/: " + (", ".join(s.files) if s.files else "none"))]
    width = max(len(r[0]) for r in rows)
    lines = [f"| {'':<{width}} | {run_label(s.algo, s.allocator, sampler)} |", f"|{'-' * (width + 2)}|{'-' * 24}|"]
    lines += [f"| {a:<{width}} | {b} |" for a, b in rows]
    return "\n".join(lines)
