"""``sara bench ds-estimate``: the "DS would have spent" estimate of ``sara train`` checked against real DS runs.

``sara train`` ends with an estimate of what Dynamic Sampling would have spent for the effective groups the run
trained on: ``k / P(mixed)`` rollouts per effective group, ``P(mixed)`` fitted to every unit the run closed
(``sara.metrics.OutcomeCounts``). This bench runs each allocator spec and DS itself with the same config, seed and
number of steps, and puts the estimate beside what DS really spent per effective group. The two runs train different
policies after their first step, so the comparison measures the estimate as a user reads it: a prediction of the DS
run they did not make.

A spec is ``ALLOCATOR[@SAMPLER]`` (``sara@predictive`` trains with ``sampler=predictive``).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import Field, field_validator

from sara.config import SaraModel
from sara.specs import parse_allocation

__all__ = ["DSEstimateBenchConfig", "format_table", "run_ds_estimate_bench"]


class DSEstimateBenchConfig(SaraModel):
    """Options of ``sara bench ds-estimate``."""

    config: str | None = None
    """A ``sara train`` config file (YAML/JSON); None = the embedded default."""
    allocators: list[str] = Field(default_factory=lambda: ["sara", "sara_paper", "sara@predictive"], min_length=1,
                                  max_length=16)
    """Specs ``ALLOCATOR[@SAMPLER]`` whose estimate is checked."""
    seeds: int = Field(2, ge=1, le=64)
    """Seeds 0..seeds-1; every spec and DS run once per seed."""
    overrides: list[str] = Field(default_factory=list, max_length=64)
    """``KEY=VALUE`` overrides of the train config, as ``sara train --set`` takes them."""

    @field_validator("allocators")
    @classmethod
    def _allocation_specs(cls, v: Any) -> Any:
        for spec in (v,) if isinstance(v, str) else v:
            parse_allocation(spec, field="")  # ALLOCATOR[@SAMPLER], refused before any run
        return v


def _train(cfg: Any, spec: str, seed: int, out_dir: str) -> dict[str, Any]:
    from sara.train import Trainer

    pair = parse_allocation(spec, field="allocators", what="bench ds-estimate")
    run_cfg = cfg.model_validate({**cfg.model_dump(), "allocator": pair.allocator, "sampler": pair.sampler_or("uniform"),
                                  "seed": seed, "out_dir": out_dir, "progress": False, "tensorboard": False})
    with Trainer(run_cfg) as trainer:
        s = trainer.train()
    per_eff = s.rollouts / s.effective_groups if s.effective_groups else float("nan")
    return {"spec": spec, "seed": seed, "steps": s.steps, "rollouts": s.rollouts,
            "effective_groups": s.effective_groups, "rollouts_per_effective_group": per_eff,
            "p_mixed": s.p_mixed, "ds_rollouts_estimate": s.ds_rollouts_estimate}


def run_ds_estimate_bench(cfg: DSEstimateBenchConfig,
                          log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run every spec and DS for every seed; see the module docstring.

    Returns:
        ``{"config", "runs": [per run: spec, seed, steps, rollouts, effective_groups, rollouts_per_effective_group,
        p_mixed, ds_rollouts_estimate, and for the specs: ds_real_per_effective_group, estimate_per_effective_group,
        error (estimate / real - 1), saved_estimated, saved_real]}, "summary": {spec: mean and range of those}}``.
    """
    from sara.train import load_config

    base = load_config(cfg.config, list(cfg.overrides))
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sara-ds-estimate-") as tmp:
        for seed in range(cfg.seeds):
            log(f"seed {seed}: ds")
            ds = _train(base, "ds", seed, f"{tmp}/ds-{seed}")
            runs.append(ds)
            for i, spec in enumerate(cfg.allocators):
                log(f"seed {seed}: {spec}")
                row = _train(base, spec, seed, f"{tmp}/{i}-{seed}")
                real = ds["rollouts_per_effective_group"]
                est = base.k / row["p_mixed"] if row["p_mixed"] > 0 else float("nan")
                own = row["rollouts_per_effective_group"]
                row.update(ds_real_per_effective_group=real, estimate_per_effective_group=est,
                           error=est / real - 1.0, saved_estimated=1.0 - own / est, saved_real=1.0 - own / real)
                runs.append(row)
    return {"config": cfg.model_dump(), "k": base.k, "steps": base.steps, "runs": runs,
            "summary": summarize(runs, cfg.allocators)}


def summarize(runs: Sequence[dict[str, Any]], specs: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per spec: the mean estimate and real DS rollouts per effective group, the mean and extreme relative error,
    and the mean estimated and real saving."""
    out: dict[str, dict[str, float]] = {}
    for spec in specs:
        rows = [r for r in runs if r["spec"] == spec and "error" in r]
        mean = lambda key, rows=rows: sum(r[key] for r in rows) / len(rows)  # noqa: E731
        errors = [r["error"] for r in rows]
        out[spec] = {"estimate_per_effective_group": mean("estimate_per_effective_group"),
                     "ds_real_per_effective_group": mean("ds_real_per_effective_group"), "error": mean("error"),
                     "error_min": min(errors), "error_max": max(errors), "saved_estimated": mean("saved_estimated"),
                     "saved_real": mean("saved_real"), "seeds": len(rows)}
    return out


def format_table(report: dict[str, Any]) -> str:
    """The summary as a markdown table, one row per spec."""
    lines = [f"{report['steps']} steps, k = {report['k']}, mean over seeds (error: estimate / real DS - 1, "
             "min..max over seeds)", "",
             "| spec | its rollouts / eff. group | DS est. | DS real | error | saved: est. | saved: real |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    own = {spec: [r["rollouts_per_effective_group"] for r in report["runs"] if r["spec"] == spec and "error" in r]
           for spec in report["summary"]}
    for spec, s in report["summary"].items():
        mine = sum(own[spec]) / len(own[spec])
        err = f"{s['error']:+.1%} ({s['error_min']:+.1%}..{s['error_max']:+.1%})"
        lines.append(f"| `{spec}` | {mine:.2f} | {s['estimate_per_effective_group']:.2f} | "
                     f"{s['ds_real_per_effective_group']:.2f} | {err} | {_pct(s['saved_estimated'])} | "
                     f"{_pct(s['saved_real'])} |")
    return "\n".join(lines)


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:.1%}"
