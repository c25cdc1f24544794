"""What to do with the groups a step commits beyond its batch (docs/training.md, "Surplus groups"), on simulated pools.

Every variant runs ``--steps`` collection steps of ``--groups`` groups x k=8 on a ``SimulatedEnv`` population, with
the trainer's bank rule for the next step's target (``SurplusBank.need``: the batch minus what is banked), and
reports rollouts generated per trained group, the batch size (max, p95), the mean lag of trained groups (weight
updates between generation and training), the share of committed groups never trained and generation rounds per
step:

* ``bank``: ``sara.train.bank.SurplusBank`` (every banked group trained in the next step; the batch grows);
* ``bounded L``: a batch of at most ``--groups`` groups, banked groups oldest first, a group older than ``L`` updates
  dropped (and whatever cannot be trained within ``L`` steps dropped at once);
* ``ds:max_oversample=C``: the bank, with DS's generation batch capped at ``C`` prompts per group still needed.

::

    python benchmarks/surplus_bank.py --population u-shaped --seeds 4
    python benchmarks/surplus_bank.py --population beta:0.05,0.05 --seeds 4
"""

from __future__ import annotations

import argparse

import numpy as np


def run(population: str, spec: str, seed: int, steps: int, groups: int, lag: int | None) -> dict[str, float]:
    from sara.allocators import compose, make_allocator, make_sampler
    from sara.collect import collect
    from sara.envs.sim.binary import SimulatedEnv

    env = SimulatedEnv(population, size=5000, seed=seed)
    alloc, sampler = compose(make_allocator(spec, k=8), make_sampler("uniform", len(env.prompts), seed=seed, k=8),
                             env.prompts)
    bank: list[int] = []  # the step each banked group was generated at
    trained = rollouts = dropped = rounds = 0
    batches: list[int] = []
    lags: list[int] = []
    for t in range(steps):
        res = collect(alloc, env, sampler, target_groups=max(1, groups - len(bank)), seed=seed, step=t)
        rollouts += res.stats.rollouts
        rounds += res.stats.rounds
        pool = bank + [t] * len(res.groups)
        if lag is None:  # SurplusBank: all banked groups, then fresh ones up to the batch
            room = max(0, groups - len(bank))
            batch, bank = pool[: len(bank) + room], pool[len(bank) + room:]
        else:
            alive = [s for s in pool if t - s <= lag]
            batch, bank = alive[:groups], alive[groups:groups * (lag + 1)]
            dropped += len(pool) - len(batch) - len(bank)
        trained += len(batch)
        batches.append(len(batch))
        lags += [t - s for s in batch]
    return {"rollouts_per_trained_group": rollouts / trained, "batch_max": max(batches),
            "batch_p95": float(np.percentile(batches, 95)), "mean_lag": float(np.mean(lags)),
            "dropped_share": dropped / (trained + dropped + len(bank)), "rounds_per_step": rounds / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--population", default="u-shaped", help="SimulatedEnv population spec")
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--groups", type=int, default=8, help="groups per training batch")
    args = p.parse_args()
    variants = [("ds:max_oversample=64", "bank", None), ("ds:max_oversample=64", "bounded 1", 1),
                ("ds:max_oversample=64", "bounded 2", 2), ("ds:max_oversample=4", "bank", None),
                ("ds:max_oversample=8", "bank", None), ("sara", "bank", None)]
    print(f"{'allocator':22s} {'surplus':10s} rollouts/trained  batch max  p95   lag   dropped  rounds/step")
    for spec, name, lag in variants:
        rs = [run(args.population, spec, s, args.steps, args.groups, lag) for s in range(args.seeds)]
        mean = {k: float(np.mean([r[k] for r in rs])) for k in rs[0]}
        print(f"{spec:22s} {name:10s} {mean['rollouts_per_trained_group']:16.2f} {max(r['batch_max'] for r in rs):10d} "
              f"{mean['batch_p95']:5.1f} {mean['mean_lag']:5.2f} {mean['dropped_share']:8.3f} {mean['rounds_per_step']:12.2f}",
              flush=True)


if __name__ == "__main__":
    main()
