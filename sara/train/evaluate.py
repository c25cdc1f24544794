"""Held-out evaluation of a training run: accuracy with fixed seeds, so evaluations are comparable."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from sara.metrics import BAND_PREFIX
from sara.priors.features import LENGTH, NUMERIC_BINS, prompt_length, quantile_bins
from sara.timing import PhaseTimer

if TYPE_CHECKING:
    from sara.envs.base import RolloutEnv
    from sara.train.flops import FlopFloor
    from sara.train.progress import StepProgress
    from sara.train.sections import EvalConfig

__all__ = ["held_out_accuracy"]


def held_out_accuracy(ec: EvalConfig, seed: int, eval_env: RolloutEnv | None, greedy_env: RolloutEnv | None = None,
                      progress: StepProgress | None = None, floor: FlopFloor | None = None) -> dict[str, float]:
    """``eval/acc_sample`` (training temperature, ``ec.samples`` per prompt), the same per ``ec.by`` label
    (``eval/acc_sample/<label>``), the fractions of held-out prompts solved / unsolved / mixed, ``eval/acc_greedy``
    (when ``ec.greedy``), ``time/eval``, the evaluation's peak resident size (``sys/peak_rss_mb/eval``) and, given a
    ``floor`` that knows the policy, the FLOP floor of its generation calls (``eval/flop_floor``).

    Args:
        ec: The run's evaluation settings (``TrainConfig.eval``).
        seed: The run's seed (the evaluation's rollout seeds derive from it).
        eval_env: Environment over the held-out prompts at the training temperature (None: no held-out split, ``{}``).
        greedy_env: The same prompts decoded greedily (needed when ``ec.greedy``).
        progress: A ``sara.train.progress.StepProgress`` told when each evaluation starts and how long it took.
        floor: The run's ``sara.train.flops.FlopFloor``.
    """
    if eval_env is None:
        return {}
    timer = PhaseTimer(memory=True)
    with timer("eval"):
        out = _accuracy(ec, seed, eval_env, greedy_env, progress, floor)
    out.update(timer.metrics())
    if progress is not None:
        progress.eval_seconds = out["time/eval"]
    return out


def _accuracy(ec: EvalConfig, seed: int, eval_env: RolloutEnv, greedy_env: RolloutEnv | None,
              progress: StepProgress | None, floor: FlopFloor | None) -> dict[str, float]:
    from sara.seeding import derive_seeds
    from sara.types import RolloutRequest

    prompts = list(eval_env.prompts[: ec.num_prompts])
    seeds = derive_seeds(seed, 0xE7A1, np.arange(len(prompts))[:, None], np.arange(ec.samples)[None])
    reqs = [RolloutRequest(unit_id=i, pool_index=i, prompt=p, seeds=tuple(int(x) for x in seeds[i]))
            for i, p in enumerate(prompts)]
    if progress is not None:
        progress.evaluating(len(prompts) * ec.samples)
    sampled = eval_env.rollout(reqs)
    per_prompt = np.array([[r.reward for r in rs] for rs in sampled]).mean(1)
    out = {"eval/acc_sample": float(per_prompt.mean()),
           "eval/frac_prompts_mixed": float(((per_prompt > 0) & (per_prompt < 1)).mean()),
           "eval/frac_prompts_solved": float((per_prompt == 1).mean()),
           "eval/frac_prompts_unsolved": float((per_prompt == 0).mean())}
    out.update(_by_label(prompts, per_prompt, ec.by))
    calls = [sampled]  # each a generation call: its prompts prefilled once
    if ec.greedy:
        reqs = [RolloutRequest(unit_id=i, pool_index=i, prompt=p, seeds=(0,)) for i, p in enumerate(prompts)]
        if progress is not None:
            progress.evaluating(len(prompts), "greedy held-out", quote_last=False)
        greedy = cast("RolloutEnv", greedy_env)  # given with ec.greedy (see Args)
        greedy_rollouts = greedy.rollout(reqs)
        out["eval/acc_greedy"] = float(np.mean([rs[0].reward for rs in greedy_rollouts]))
        calls.append(greedy_rollouts)
    flops = sum(floor.generation(r for rs in call for r in rs) for call in calls) if floor is not None else math.nan
    if math.isfinite(flops):
        out["eval/flop_floor"] = flops
    return out


def _by_label(prompts: list[Any], per_prompt: np.ndarray, by: str | None, max_labels: int = 32) -> dict[str, float]:
    """``eval/acc_sample/<label>``: mean accuracy of the held-out prompts per value of ``metadata[key]`` (prompts
    without the key are left out; nothing when no prompt has it or it has more than ``max_labels`` values). The key
    ``<length>`` labels each prompt by its length in characters, by value when it takes at most ``max_labels`` values,
    else in ``NUMERIC_BINS`` quantile bins named ``<shortest>-<longest>``: the bands ``group_by=auto`` can split a
    pool without metadata into. ``by`` may list keys joined by ``|``; the first that labels the prompts is used."""
    for key in (by or "").split("|"):
        key = key.strip()
        if not key:
            continue
        if key == LENGTH:
            lab = _length_labels(prompts, max_labels)
        else:
            values = [p.metadata.get(key) for p in prompts]
            lab = np.array(["" if v is None else str(v) for v in values])
        names = sorted(set(lab.tolist()) - {""}, key=_natural)
        if names and len(names) <= max_labels:
            return {f"{BAND_PREFIX}{n}": float(per_prompt[lab == n].mean()) for n in names}
    return {}


def _length_labels(prompts: list[Any], max_labels: int) -> np.ndarray:
    lengths = np.array([prompt_length(p) for p in prompts], np.int64)
    if len(np.unique(lengths)) <= max_labels:
        return lengths.astype(str)
    bins = quantile_bins(lengths.astype(np.float64), NUMERIC_BINS)
    if bins is None:
        return lengths.astype(str)
    out = np.empty(len(lengths), dtype=object)
    for b in np.unique(bins):
        at = bins == b
        out[at] = f"{lengths[at].min()}-{lengths[at].max()}"
    return out.astype(str)


def _natural(label: str) -> tuple[float, str]:
    """Numeric labels (``7``, ``12-30``) in numeric order, the rest after them alphabetically."""
    head = label.split("-", 1)[0]
    return (float(head), label) if head.isdigit() else (float("inf"), label)
