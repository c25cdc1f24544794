"""The allocation benchmark: rollouts per effective group of each allocator on a simulated prompt pool.

Every allocator runs on the same pool, the same prompt order and the same per-rollout random numbers (rewards are a
function of the rollout seed), so ratios are paired comparisons measured in one run. DS is always measured as the
reference (added if not asked for).

Multi-step mode (``pool_epochs`` / ``drift``): the same allocator and sampler run ``ceil(pool_epochs * pool_size /
target_groups)`` steps over one pool while success rates drift as a policy's would (``drift_rates``: prompts trained in
an effective group improve fastest). A spec may carry its own sampler as ``spec@sampler`` (e.g.
``sara:prior=history@predictive``); others use ``sampler``, except the reference, which samples uniformly (the
paper's DS baseline) unless written with ``@``. Starvation is reported beside every row: the fraction of the pool never
drawn, and never revisited (drawn at most once).

``spec@oracle`` is not a method but the floor: ``OracleSampler`` reads the simulator's true (drifting) success rates and
hands out the prompts most likely to give a mixed group. With complete groups nothing can spend fewer than k rollouts
per effective group, so on a pool where DS finds a fraction P of groups mixed no method goes below ``P x`` DS; the
oracle row shows how close to that a sampler with perfect knowledge gets under the same drift.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, field_validator

from sara.allocators import make_allocator
from sara.bench.summary import group_ratios
from sara.build import build_allocation
from sara.commands.counts import MAX_BATCH, MAX_GROUP, MAX_POOL, MAX_SEEDS, MAX_STEPS
from sara.config import SaraModel
from sara.driver import collect
from sara.envs.sim.binary import SimulatedEnv
from sara.metrics import save_figure
from sara.samplers import PromptSampler, UniformSampler
from sara.specs import parse_allocation
from sara.step import WrongAbandons
from sara.types import CollectStats

__all__ = ["AllocationBenchConfig", "AllocatorResult", "OracleSampler", "compare_on_env", "run_allocation_bench",
           "format_table", "plot_results"]


class AllocationBenchConfig(SaraModel):
    """Options of ``sara bench allocation`` (the CLI's flags; invalid values raise ``ConfigError`` naming the field)."""

    population: str = "u-shaped"
    """Success-rate population: u-shaped | mid-training | uniform | beta:A,B | file:PATH (one rate per line) |
    features:informative / uninformative / misleading (prompts carry ``band`` / ``size`` features; for
    ``sara:group_by=auto``)."""
    k: int = Field(8, ge=2, le=MAX_GROUP)
    """Group size."""
    target_groups: int = Field(512, ge=1, le=MAX_BATCH)
    """Committed groups per step."""
    seeds: int = Field(3, ge=1, le=MAX_SEEDS)
    """Independent pools (seeds 0..N-1)."""
    pool_size: int = Field(20_000, ge=1, le=MAX_POOL)
    """Prompts per simulated pool."""
    steps: int = Field(1, ge=1, le=MAX_STEPS)
    """Collection steps per seed (ignored in multi-step mode, see ``pool_epochs``)."""
    allocators: tuple[str, ...] = Field(("uniform", "ds", "sara"), min_length=1)
    """Allocator specs to compare; a spec may carry its own sampler as ``spec@sampler``."""
    sampler: str = "uniform"
    """Prompt sampler spec of every allocator without ``@`` (the reference samples uniformly unless written with ``@``)."""
    reference: str = "ds"
    """The reference allocator of the ratios (added to the run if not among ``allocators``)."""
    pool_epochs: float | None = Field(None, gt=0.0)
    """Multi-step mode: ``ceil(pool_epochs x pool_size / target_groups)`` steps over the same pool (passes over the
    prompt pool); reports starvation."""
    drift: float = Field(0.0, ge=0.0)
    """Per-step drift of success rates on the logit scale, larger for trained prompts (``drift_rates``)."""

    @field_validator("allocators", "reference")
    @classmethod
    def _allocation_specs(cls, v: Any) -> Any:
        for spec in (v,) if isinstance(v, str) else v:
            parse_allocation(spec, field="")  # ALLOCATOR[@SAMPLER], refused before any run
        return v


@dataclass
class AllocatorResult:
    """Aggregated over seeds and steps. Ratios are relative to the reference (DS) in the same run."""

    allocator: str
    rollouts_per_effective_group: float
    tokens_per_effective_group: float
    ratio_vs_ds: float
    token_ratio_vs_ds: float
    wrong_abandon_rate: float
    rounds_per_step: float
    allocator_seconds_per_decision: float
    waste_fraction: float
    effective_fraction: float
    abandon_rate: float
    rollouts: int
    effective_groups: int
    ratio_vs_ds_per_seed: list[float] = field(default_factory=list)
    stop_reasons: dict[str, int] = field(default_factory=dict)
    starvation_rate: float = 0.0
    never_revisited_rate: float = 0.0


def drift_rates(rates: np.ndarray, trained: np.ndarray, drift: float, rng: np.random.Generator) -> np.ndarray:
    """One step of policy-like drift on the logit scale: every prompt moves ``+drift/4`` (generalization), prompts
    trained in an effective group ``+drift`` more, plus ``N(0, (drift/2)^2)`` noise."""
    r = np.clip(rates, 1e-6, 1 - 1e-6)
    logit = np.log(r / (1 - r)) + drift * (0.25 + trained) + 0.5 * drift * rng.standard_normal(len(r))
    return 1.0 / (1.0 + np.exp(-logit))


class OracleSampler(PromptSampler):
    """Benchmark reference, not a method: the free prompts with the largest TRUE probability of a mixed group of k.

    Reads ``env.rates`` at every draw (so it follows drift); ties are broken at random (seeded).
    """

    name = "oracle"

    def __init__(self, env: SimulatedEnv, k: int, *, seed: int = 0) -> None:
        super().__init__(len(env.prompts), seed=seed)
        self.env, self.k = env, int(k)
        self._taken = np.zeros(self.pool_size, bool)
        self._calls = 0

    def sample(self, m: int) -> np.ndarray:
        p = np.asarray(self.env.rates, np.float64)
        score = 1.0 - p**self.k - (1.0 - p) ** self.k
        free = np.flatnonzero(~self._taken)
        tie = np.random.default_rng([self.seed, self._calls]).random(len(free))
        self._calls += 1
        out = free[np.lexsort((tie, -score[free]))[: max(int(m), 0)]].astype(np.int64)
        self._taken[out] = True
        return out

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        self._taken[:] = False


_ROW_KEYS = ("rollouts_per_effective_group", "tokens_per_effective_group", "wrong_abandon_rate", "waste_fraction")


def compare_on_env(specs: Sequence[str], make_env: Callable[[int], Any], *, pool_size: int, target_groups: int,
                   seeds: int, k: int) -> list[dict[str, Any]]:
    """One collection step per spec and seed on ``make_env(seed)`` (same pools, same rollout seeds): rollouts and
    tokens per effective group, wrong-abandon rate and waste per spec, with ratios relative to the first spec."""
    rows = []
    for spec in specs:
        stats = []
        for s in range(seeds):
            env = make_env(s)
            stats.append(collect(make_allocator(spec, k=k), env, UniformSampler(pool_size, seed=s),
                                 target_groups=target_groups, seed=s, observers=[WrongAbandons(env)]).stats)
        rows.append({"allocator": spec, **{key: v for key, v in group_ratios(stats).items() if key in _ROW_KEYS}})
    for r in rows:
        r["ratio_vs_first"] = r["rollouts_per_effective_group"] / rows[0]["rollouts_per_effective_group"]
        r["token_ratio_vs_first"] = r["tokens_per_effective_group"] / rows[0]["tokens_per_effective_group"]
    return rows


def num_steps(cfg: AllocationBenchConfig) -> int:
    """Steps per seed: ``ceil(pool_epochs * pool_size / target_groups)`` in multi-step mode, else ``steps``."""
    return cfg.steps if cfg.pool_epochs is None else max(1, math.ceil(cfg.pool_epochs * cfg.pool_size /
                                                                      cfg.target_groups))


def _run_one(spec: str, cfg: AllocationBenchConfig, seed: int) -> tuple[list[CollectStats], np.ndarray]:
    pair = parse_allocation(spec, field="allocators", what="bench allocation")
    env = SimulatedEnv(cfg.population, size=cfg.pool_size, seed=seed)
    sampler_spec = pair.sampler_or("uniform" if spec == cfg.reference else cfg.sampler)
    given: PromptSampler | str = OracleSampler(env, cfg.k, seed=seed) if sampler_spec == "oracle" else sampler_spec
    built = build_allocation(pair.allocator, given, k=cfg.k, prompts=env.prompts, seed=seed)  # sara@predictive:
    allocator, sampler = built.allocator, built.sampler  # SARA reads the sampler's history
    rng = np.random.default_rng([seed, 4242])
    visits = np.zeros(len(env.prompts), np.int64)
    stats = []
    for t in range(num_steps(cfg)):
        res = collect(allocator, env, sampler, target_groups=cfg.target_groups, seed=seed, step=t,
                      observers=[WrongAbandons(env)])
        stats.append(res.stats)
        for g in (*res.groups, *res.abandoned, *res.discarded):
            visits[g.pool_index] += 1
        if cfg.drift:
            trained = np.zeros(len(env.rates))
            trained[[g.pool_index for g in res.groups if g.is_effective(allocator.eps)]] = 1.0
            env.rates = drift_rates(env.rates, trained, cfg.drift, rng)
    return stats, visits


def _aggregate(spec: str, runs: list[tuple[list[CollectStats], np.ndarray]]) -> dict[str, Any]:
    per_seed = [r[0] for r in runs]
    flat = [s for seed_stats in per_seed for s in seed_stats]

    def tot(name: str) -> float:
        return float(sum(s.__dict__[name] or 0 for s in flat))

    reasons: dict[str, int] = {}
    for s in flat:
        reasons[s.stop_reason] = reasons.get(s.stop_reason, 0) + 1
    ratios = group_ratios(flat)
    return {
        "allocator": spec,
        "rollouts_per_effective_group": ratios["rollouts_per_effective_group"],
        "tokens_per_effective_group": ratios["tokens_per_effective_group"],
        "wrong_abandon_rate": ratios["wrong_abandon_rate"],
        "rounds_per_step": tot("rounds") / len(flat),
        "allocator_seconds_per_decision": tot("allocator_seconds") / max(tot("decisions"), 1.0),
        "waste_fraction": ratios["waste_fraction"],
        "effective_fraction": ratios["effective_fraction"],
        "abandon_rate": ratios["abandon_rate"],
        "rollouts": int(tot("rollouts")),
        "effective_groups": int(tot("effective_groups")),
        "_per_seed_rpeg": [group_ratios(ss)["rollouts_per_effective_group"] for ss in per_seed],
        "stop_reasons": reasons,
        "starvation_rate": float(np.mean([np.mean(v == 0) for _, v in runs])),
        "never_revisited_rate": float(np.mean([np.mean(v <= 1) for _, v in runs])),
    }


def run_allocation_bench(cfg: AllocationBenchConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every allocator on ``cfg.seeds`` simulated pools; return ``{"config": ..., "results": [...]}``. ``log``
    gets a progress line as each (allocator, seed) run starts."""
    specs = list(dict.fromkeys(cfg.allocators))
    ref_added = cfg.reference not in specs
    order = ([cfg.reference] if ref_added else []) + specs

    def one(i: int, spec: str, seed: int) -> dict[str, Any]:
        if log is not None:
            log(f"{spec} ({i + 1}/{len(order)}), seed {seed + 1}/{cfg.seeds}")
        return _run_one(spec, cfg, seed)

    runs = {spec: _aggregate(spec, [one(i, spec, seed) for seed in range(cfg.seeds)]) for i, spec in enumerate(order)}
    ref = runs[cfg.reference]
    results = []
    for spec in specs:
        r = dict(runs[spec])
        per_seed = r.pop("_per_seed_rpeg")
        r["ratio_vs_ds"] = r["rollouts_per_effective_group"] / ref["rollouts_per_effective_group"]
        r["token_ratio_vs_ds"] = r["tokens_per_effective_group"] / ref["tokens_per_effective_group"]
        r["ratio_vs_ds_per_seed"] = [a / b for a, b in zip(per_seed, ref["_per_seed_rpeg"])]
        results.append(asdict(AllocatorResult(**r)))
    return {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.model_dump().items()},
            "reference_added": ref_added, "results": results}


def format_table(report: dict[str, Any]) -> str:
    """A markdown table of the main columns."""
    cols = [("allocator", "allocator", "{}"), ("rollouts/eff. group", "rollouts_per_effective_group", "{:.2f}"),
            ("× DS", "ratio_vs_ds", "{:.3f}"), ("tokens × DS", "token_ratio_vs_ds", "{:.3f}"),
            ("wrong-abandon", "wrong_abandon_rate", "{:.3f}"), ("waste", "waste_fraction", "{:.3f}"),
            ("rounds/step", "rounds_per_step", "{:.1f}"), ("µs/decision", "allocator_seconds_per_decision", "{:.3f}")]
    if report["config"].get("pool_epochs") is not None:
        cols += [("never drawn", "starvation_rate", "{:.3f}"), ("never revisited", "never_revisited_rate", "{:.3f}")]
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in report["results"]:
        vals = [fmt.format(r[key] * 1e6 if key == "allocator_seconds_per_decision" else r[key]) for _, key, fmt in cols]
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


def plot_results(report: dict[str, Any], path: str | Path) -> Path | None:
    """Bar chart of rollouts per effective group relative to DS, wrong-abandon rate annotated (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    res = report["results"]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.4 * len(res)), 3.6))
    ratios = [r["ratio_vs_ds"] for r in res]
    errs = [float(np.std(r["ratio_vs_ds_per_seed"])) for r in res]
    bars = ax.bar(range(len(res)), ratios, yerr=errs, color="#4c72b0", capsize=3)
    for b, r in zip(bars, res):
        ax.annotate(f"wrong-ab. {r['wrong_abandon_rate']:.1%}", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=7, xytext=(0, 3), textcoords="offset points")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(res)), [r["allocator"] for r in res], rotation=20, ha="right", fontsize=7)
    c = report["config"]
    ax.set_ylabel("rollouts per effective group ÷ DS")
    ax.set_title(f"population={c['population']}  k={c['k']}  target={c['target_groups']}  seeds={c['seeds']}", fontsize=8)
    return save_figure(fig, path, dpi=120)


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path
