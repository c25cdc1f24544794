"""Held-out evaluation of a training run: accuracy with fixed seeds, so evaluations are comparable."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["held_out_accuracy"]


def held_out_accuracy(config: Any, eval_env: Any, greedy_env: Any = None) -> dict[str, float]:
    """``eval/acc_sample`` (training temperature, ``config.eval.samples`` per prompt), the same per
    ``config.eval.by`` label (``eval/acc_sample/<label>``), the fractions of held-out prompts solved / unsolved / mixed,
    ``eval/acc_greedy`` (when ``config.eval.greedy``) and ``time/eval``.

    Args:
        config: The run's ``TrainConfig`` (``eval`` and ``seed`` are read).
        eval_env: Environment over the held-out prompts at the training temperature (None: no held-out split, ``{}``).
        greedy_env: The same prompts decoded greedily (needed when ``config.eval.greedy``).
    """
    from sara.seeding import derive_seeds
    from sara.types import RolloutRequest

    ec = config.eval
    if eval_env is None:
        return {}
    t0 = time.perf_counter()
    prompts = list(eval_env.prompts[: ec.num_prompts])
    seeds = derive_seeds(config.seed, 0xE7A1, np.arange(len(prompts))[:, None], np.arange(ec.samples)[None])
    reqs = [RolloutRequest(unit_id=i, pool_index=i, prompt=p, seeds=tuple(int(x) for x in seeds[i]))
            for i, p in enumerate(prompts)]
    per_prompt = np.array([[r.reward for r in rs] for rs in eval_env.rollout(reqs)]).mean(1)
    out = {"eval/acc_sample": float(per_prompt.mean()),
           "eval/frac_prompts_mixed": float(((per_prompt > 0) & (per_prompt < 1)).mean()),
           "eval/frac_prompts_solved": float((per_prompt == 1).mean()),
           "eval/frac_prompts_unsolved": float((per_prompt == 0).mean())}
    out.update(_by_label(prompts, per_prompt, ec.by))
    if ec.greedy:
        reqs = [RolloutRequest(unit_id=i, pool_index=i, prompt=p, seeds=(0,)) for i, p in enumerate(prompts)]
        out["eval/acc_greedy"] = float(np.mean([rs[0].reward for rs in greedy_env.rollout(reqs)]))
    out["time/eval"] = time.perf_counter() - t0
    return out


def _by_label(prompts: list[Any], per_prompt: np.ndarray, key: str | None, max_labels: int = 32) -> dict[str, float]:
    """``eval/acc_sample/<label>``: mean accuracy of the held-out prompts per value of ``metadata[key]`` (prompts
    without the key are left out; nothing when no prompt has it or it has more than ``max_labels`` values)."""
    if key is None:
        return {}
    labels = [p.metadata.get(key) for p in prompts]
    names = sorted({str(v) for v in labels if v is not None})
    if not names or len(names) > max_labels:
        return {}
    lab = np.array(["" if v is None else str(v) for v in labels])
    return {f"eval/acc_sample/{n}": float(per_prompt[lab == n].mean()) for n in names}
