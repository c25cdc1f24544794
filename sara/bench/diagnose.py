"""Where an allocator's rollouts go, and how much learning signal they buy (``sara bench`` diagnosis).

``AllocationDiagnostics`` is a driver observer that splits every step's rollouts into committed / abandoned /
saturated (a complete unmixed group, discarded) / in flight at the step's end (probing units cut off when the target
was reached, discarded), records each committed group's success rate ``q`` and its GRPO signal ``sqrt(q (1 - q))``
(a group's sum of |advantage| is ``2 k sqrt(q (1 - q))``), and counts wrong abandons: on a simulator from its
counterfactual, on a real environment by finishing the abandoned groups offline with the seeds the driver would have
used (``finish=True``; analysis rollouts, not counted in the step).

``diagnose_policy`` runs allocator specs on a frozen policy (optionally after training it a few steps with the run's
own allocator), on the same prompts and rollout seeds, and estimates the pool's success-rate population by sampling;
``population_figures`` evaluates DS, the paper's rule and the optimal rule exactly on that population.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sara.driver import collect
from sara.seeding import derive_seeds
from sara.specs import parse_allocation
from sara.step import CollectObserver, Counterfactual, StepState
from sara.types import Decision, RolloutRequest

__all__ = ["AllocationDiagnostics", "diagnose_policy", "estimate_rates", "population_figures", "sample_outcomes",
           "summarize"]

Q_BINS = (0.0, 0.25, 0.5, 0.75, 1.0)


class AllocationDiagnostics(CollectObserver):
    """Per-step breakdown of rollouts and signal (``records``: one dict per step; ``stats`` adds nothing).

    Args:
        env: The environment (for wrong abandons: ``counterfactual_mixed`` on a simulator, else ``rollout``).
        finish: Finish abandoned groups on a real environment to count wrong abandons (extra analysis rollouts).
    """

    def __init__(self, env: Any = None, *, finish: bool = False) -> None:
        self.env, self.finish = env, bool(finish)
        self.records: list[dict[str, Any]] = []
        self._cur: dict[str, Any] = {}

    def begin(self, state: StepState) -> None:
        self._cur = {"committed_q": [], "committed_rollouts": 0, "abandoned_rollouts": 0, "abandoned_tokens": 0,
                     "abandoned_success_prefix": 0, "abandoned": 0, "wrong_abandons": 0, "saturated_rollouts": 0,
                     "in_flight_rollouts": 0, "in_flight_tokens": 0, "saturated": 0, "in_flight": 0,
                     "committed_tokens": 0, "abandoned_n": []}
        self.records.append(self._cur)

    def _wrong(self, state: StepState, ab: np.ndarray) -> int:
        pool, occ = state.pool_index(ab), state.occurrence[ab]
        if isinstance(self.env, Counterfactual):
            seeds = derive_seeds(state.seed, state.step, pool[:, None], occ[:, None], np.arange(state.k)[None, :])
            return int(self.env.counterfactual_mixed(pool, seeds, state.eps).sum())
        if not self.finish or self.env is None:
            return 0
        reqs, seen = [], []
        for u, p, o in zip(ab.tolist(), pool.tolist(), occ.tolist()):
            rs = [r.reward for r in state.rollouts_of[u]]
            seen.append(rs)
            j = np.arange(len(rs), state.k)
            seeds = derive_seeds(state.seed, state.step, p, o, j)
            reqs.append(RolloutRequest(unit_id=u, pool_index=p, prompt=self.env.prompts[p],
                                       seeds=tuple(int(x) for x in np.atleast_1d(seeds))))
        results = self.env.rollout(reqs)
        return sum(int(np.std(rs + [r.reward for r in res]) > state.eps) for rs, res in zip(seen, results))

    def closed(self, state: StepState, unit_ids: np.ndarray, decisions: np.ndarray) -> None:
        c, k = self._cur, state.k
        for u, d in zip(unit_ids.tolist(), decisions.tolist()):
            rs = state.rollouts_of[u]
            r = np.array([x.reward for x in rs])
            toks = sum(x.num_tokens for x in rs)
            if d == Decision.COMMIT:
                c["committed_q"].append(float(r.mean()) if len(r) else 0.0)
                c["committed_rollouts"] += len(r)
                c["committed_tokens"] += toks
            elif d == Decision.ABANDON:
                c["abandoned"] += 1
                c["abandoned_rollouts"] += len(r)
                c["abandoned_tokens"] += toks
                c["abandoned_n"].append(len(r))
                c["abandoned_success_prefix"] += int(len(r) > 0 and r.min() > state.eps)
            elif len(r) >= k:
                c["saturated"] += 1
                c["saturated_rollouts"] += len(r)
            else:
                c["in_flight"] += 1
                c["in_flight_rollouts"] += len(r)
                c["in_flight_tokens"] += toks
        ab = unit_ids[decisions == Decision.ABANDON]
        if len(ab):
            c["wrong_abandons"] += self._wrong(state, ab)


def summarize(records: Sequence[Mapping[str, Any]], *, eps: float = 1e-6) -> dict[str, float]:
    """Totals over steps: rollouts per effective group, where rollouts went, signal, q histogram, wrong abandons."""
    q = np.array([x for r in records for x in r["committed_q"]])
    tot = {key: float(sum(r[key] for r in records)) for key in (
        "committed_rollouts", "abandoned_rollouts", "saturated_rollouts", "in_flight_rollouts", "abandoned",
        "wrong_abandons", "abandoned_success_prefix", "committed_tokens", "abandoned_tokens", "in_flight_tokens")}
    rollouts = tot["committed_rollouts"] + tot["abandoned_rollouts"] + tot["saturated_rollouts"] + tot["in_flight_rollouts"]
    eff = q[(q > eps) & (q < 1 - eps)]
    signal = float(np.sqrt(eff * (1 - eff)).sum())
    out = {"rollouts": rollouts, "effective_groups": float(len(eff)),
           "rollouts_per_effective_group": rollouts / len(eff) if len(eff) else float("inf"),
           "signal_per_1k_rollouts": 1000 * signal / rollouts if rollouts else 0.0,
           "signal_per_effective_group": signal / len(eff) if len(eff) else 0.0,
           "wrong_abandon_rate": tot["wrong_abandons"] / tot["abandoned"] if tot["abandoned"] else 0.0,
           "abandoned_success_share": tot["abandoned_success_prefix"] / tot["abandoned"] if tot["abandoned"] else 0.0,
           "abandoned_tokens_per_rollout": tot["abandoned_tokens"] / max(tot["abandoned_rollouts"], 1.0),
           "committed_tokens_per_rollout": tot["committed_tokens"] / max(tot["committed_rollouts"], 1.0)}
    for key in ("committed_rollouts", "abandoned_rollouts", "saturated_rollouts", "in_flight_rollouts"):
        out[f"share_{key}"] = tot[key] / rollouts if rollouts else 0.0
    hist, _ = np.histogram(eff, bins=Q_BINS)
    for lo, hi, h in zip(Q_BINS[:-1], Q_BINS[1:], hist):
        out[f"q_{lo:.2f}_{hi:.2f}"] = float(h) / max(len(eff), 1)
    return out


def sample_outcomes(env: Any, pool_index: np.ndarray, samples: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(rewards, generated tokens)``, each ``[prompts, samples]``: ``samples`` seeded rollouts of each prompt (seeds
    apart from training's)."""
    idx = np.asarray(pool_index, np.int64)
    seeds = derive_seeds(seed, 0x5EED, idx[:, None], np.arange(samples)[None, :])
    reqs = [RolloutRequest(unit_id=i, pool_index=int(p), prompt=env.prompts[int(p)], seeds=tuple(int(x) for x in s))
            for i, (p, s) in enumerate(zip(idx, seeds))]
    out = env.rollout(reqs)
    return (np.array([[r.reward for r in rs] for rs in out], np.float64),
            np.array([[r.num_tokens for r in rs] for rs in out], np.float64))


def estimate_rates(env: Any, pool_index: np.ndarray, samples: int, *, seed: int = 0) -> np.ndarray:
    """Each prompt's success rate estimated from ``samples`` seeded rollouts (``sample_outcomes``)."""
    return sample_outcomes(env, pool_index, samples, seed=seed)[0].mean(1)


def population_figures(rates: np.ndarray, k: int) -> dict[str, dict[str, float]]:
    """Exact per-prompt figures of DS, the paper's rule (uniform prior, tau_low 0.45) and the optimal rule (fitted to
    ``rates`` as the population) on the population ``rates`` (probe 1, complete groups)."""
    from sara.allocators.optimal import rule_figures, solve_rho
    from sara.priors.grid import GridPrior
    from sara.priors.posteriors import p_effective

    n = np.arange(k + 1)
    paper = np.asarray(p_effective(n, 0, k)) < 0.45
    paper[0] = paper[k] = False
    never = np.zeros(k + 1, bool)
    gp = GridPrior(min_units=1)
    grid = gp.grid
    # The population itself on the grid (nearest point): the rule the online fit converges to.
    w = np.bincount(np.abs(grid[None] - np.asarray(rates)[:, None]).argmin(1), minlength=len(grid)).astype(float)
    _, opt_f, opt_s = solve_rho(w / w.sum(), grid, k)
    return {"ds": rule_figures(never, never, rates, k, signal=True),
            "paper": rule_figures(paper, paper, rates, k, signal=True),
            "optimal": {**rule_figures(opt_f, opt_s, rates, k, signal=True),
                        "abandon_fail_at": float(np.argmax(opt_f) if opt_f.any() else k),
                        "abandon_success_at": float(np.argmax(opt_s) if opt_s.any() else k)}}


def diagnose_policy(config: Any, specs: Sequence[str], *, steps: int = 4, train_steps: int = 0,
                    rate_prompts: int = 300, rate_samples: int = 32, finish: bool = True,
                    seed: int = 1) -> dict[str, Any]:
    """Run allocator specs (``spec`` or ``spec@sampler``) on one frozen policy; return per-spec summaries.

    Args:
        config: A ``TrainConfig`` or its fields (task, policy, k, groups_per_step, ...).
        specs: Allocator specs to compare, each on the same prompts and rollout seeds.
        steps: Collection steps per spec (the policy does not change between them).
        train_steps: Train the policy this many steps first (with the config's allocator).
        rate_prompts: Prompts whose success rate is estimated for the population figures (0 = skip).
        rate_samples: Rollouts per prompt for that estimate.
        finish: Finish abandoned groups to count wrong abandons (extra analysis rollouts).
        seed: Seed of the diagnosis' rollouts and prompt order (apart from training's).
    """
    from sara.build import build_allocation
    from sara.train import Trainer

    pairs = [parse_allocation(spec, field="specs", what="diagnose") for spec in specs]  # refused before any work
    trainer = Trainer(config)
    for _ in range(train_steps):
        trainer.train_step()
    env, cfg = trainer.env, trainer.config
    out: dict[str, Any] = {"train_steps": train_steps, "results": {}}
    if rate_prompts:
        idx = np.random.default_rng(seed).choice(len(env.prompts), min(rate_prompts, len(env.prompts)), replace=False)
        rates = estimate_rates(env, idx, rate_samples, seed=seed)
        out["rates_mean"] = float(rates.mean())
        out["rates_hist"] = np.histogram(rates, bins=(0, 1e-9, 0.1, 0.5, 0.9, 1 - 1e-9, 1))[0].tolist()
        out["population"] = population_figures(rates, cfg.k)
    for spec, pair in zip(specs, pairs):
        built = build_allocation(pair.allocator, pair.sampler_or("uniform"), k=cfg.k, prompts=env.prompts, seed=seed)
        allocator, sampler = built.allocator, built.sampler
        obs = AllocationDiagnostics(env, finish=finish)
        for t in range(steps):
            collect(allocator, env, sampler, target_groups=cfg.groups_per_step, seed=seed, step=t, observers=[obs])
        out["results"][spec] = summarize(obs.records)
    return out
