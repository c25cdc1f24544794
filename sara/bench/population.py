"""``sara bench population``: a policy's per-prompt success rates on a run's prompt pool, and what they allow.

A run's config (or a checkpoint of it) gives the task, the policy and the backend; ``samples`` seeded rollouts of each
of ``prompts`` pool prompts (drawn with ``seed``, rollout seeds apart from training's) estimate every prompt's success
rate ``p``. From those rates: the chance that a size-k group is solved (all 1), unsolved (all 0) or mixed, the mean
rate per mixture component, the mean generated tokens of right and wrong rollouts and of the rollouts of prompts
that were solved, unsolved or mixed in the sample (where the tokens of saturated groups go), and the exact per-prompt
figures of DS, the paper's rule and the Bayes-optimal within-step rule on that population
(``sara.bench.diagnose.population_figures``: probe 1, complete groups) — the floor a within-step stopping rule can
reach on it, against which a training run's rollouts per effective group are read.

A rate estimated from ``samples`` rollouts is 0 or 1 for a prompt whose true rate is below about ``1 / samples`` from
the edge, so the group fractions and the rules' figures treat such prompts as never mixing (for DS and SARA alike).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import Field

from sara.commands.counts import MAX_POOL
from sara.config import MAX_SEED, SaraModel

__all__ = ["PopulationBenchConfig", "format_table", "run_population_bench"]


class PopulationBenchConfig(SaraModel):
    """Options of ``sara bench population``."""

    config: str | None = None
    """A ``sara train`` config file (YAML/JSON); None = the embedded default. Ignored with ``checkpoint``."""
    checkpoint: str | None = None
    """A checkpoint written by ``sara train``: its policy (and its config) instead of the starting one."""
    prompts: int = Field(300, ge=1, le=MAX_POOL)
    """Pool prompts whose success rate is estimated (at most the pool)."""
    samples: int = Field(16, ge=2, le=1024)
    """Seeded rollouts per prompt."""
    seed: int = Field(1, ge=0, le=MAX_SEED)
    """Seed of the prompt draw and the rollouts."""


def run_population_bench(cfg: PopulationBenchConfig, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Estimate the pool's success rates under the policy; see the module docstring.

    Returns:
        ``{"config", "k", "prompts", "samples", "mean", "solved", "unsolved", "mixed", "by_component",
        "population": {"ds" | "paper" | "optimal": rule figures}, "tokens": ``token_figures``, "seconds",
        "rates"}``.
    """
    import time

    from sara.bench.diagnose import population_figures, sample_outcomes
    from sara.train import TrainConfig, Trainer, load_config
    from sara.train.checkpoint import load_checkpoint

    state = load_checkpoint(cfg.checkpoint) if cfg.checkpoint else None
    base = TrainConfig(**state["config"]) if state else load_config(cfg.config)
    with tempfile.TemporaryDirectory(prefix="sara-population-") as tmp:
        train_cfg = base.model_copy(update={"out_dir": tmp, "progress": False, "tensorboard": False})
        with Trainer(train_cfg) as trainer:
            if state is not None:
                trainer.load_state_dict(state)
            env, k = trainer.env, trainer.config.k
            n = min(cfg.prompts, len(env.prompts))
            idx = np.sort(np.random.default_rng(cfg.seed).choice(len(env.prompts), n, replace=False))
            log(f"{n} prompts x {cfg.samples} samples ({'checkpoint ' + cfg.checkpoint if state else 'start'})")
            t0 = time.perf_counter()
            rewards, tokens = sample_outcomes(env, idx, cfg.samples, seed=cfg.seed)
            rates = rewards.mean(1)
            seconds = time.perf_counter() - t0
            comps = [str(env.prompts[int(i)].metadata.get("component", "")) for i in idx]
    solved, unsolved = float(np.mean(rates ** k)), float(np.mean((1.0 - rates) ** k))
    by = {c: float(rates[[x == c for x in comps]].mean()) for c in sorted(set(comps)) if c}
    return {"config": cfg.model_dump(), "k": k, "prompts": n, "samples": cfg.samples, "mean": float(rates.mean()),
            "solved": solved, "unsolved": unsolved, "mixed": 1.0 - solved - unsolved, "by_component": by,
            "population": population_figures(rates, k), "tokens": token_figures(rewards, tokens),
            "seconds": seconds, "rates": rates.tolist()}


def token_figures(rewards: np.ndarray, tokens: np.ndarray) -> dict[str, float]:
    """Mean generated tokens per rollout: all, right (reward > 0.5) and wrong rollouts, and the rollouts of prompts
    whose samples were all right (``solved``), all wrong (``unsolved``) or both (``mixed``); NaN where there are
    none."""
    right = rewards > 0.5
    solved, unsolved = right.all(1), (~right).all(1)
    mean = lambda m: float(tokens[m].mean()) if m.any() else float("nan")  # noqa: E731
    rows = np.ones_like(right)
    return {"all": mean(rows), "right": mean(right), "wrong": mean(~right), "solved": mean(rows & solved[:, None]),
            "unsolved": mean(rows & unsolved[:, None]), "mixed": mean(rows & ~(solved | unsolved)[:, None])}


def format_table(report: dict[str, Any]) -> str:
    """The report as two markdown tables (the pool; the rules on it)."""
    k = report["k"]
    lines = [f"{report['prompts']} prompts x {report['samples']} samples, mean success rate {report['mean']:.3f}",
             "", f"| size-{k} group | share |", "|---|---:|"]
    lines += [f"| {name} | {report[name]:.3f} |" for name in ("solved", "unsolved", "mixed")]
    if report["by_component"]:
        lines += ["", "| component | mean success rate |", "|---|---:|"]
        lines += [f"| {c} | {v:.3f} |" for c, v in report["by_component"].items()]
    if "tokens" in report:
        t = report["tokens"]
        lines += ["", "| rollouts | mean generated tokens |", "|---|---:|"]
        lines += [f"| {name} | {t[key]:.1f} |" for name, key in (
            ("all", "all"), ("right", "right"), ("wrong", "wrong"), ("of prompts all right in the sample", "solved"),
            ("of prompts all wrong", "unsolved"), ("of prompts with both", "mixed"))]
    lines += ["", "| rule (probe 1, complete groups) | rollouts / effective group | vs DS | wrong abandons |",
              "|---|---:|---:|---:|"]
    for name, fig in report["population"].items():
        lines.append(f"| {name} | {fig['rollouts_per_effective_group']:.2f} | {fig['ratio_vs_ds']:.3f} | "
                     f"{fig['wrong_abandon_rate']:.3f} |")
    return "\n".join(lines)
