"""Train through the Python API: config -> trainer -> a few steps -> metrics (CleanRL-style, top to bottom).

Run:  python examples/train_api.py          (a minute or two on 2 CPU cores; the first run warm-starts the policy)
"""

from __future__ import annotations

from sara.train import TrainConfig, Trainer

# 1. Config: every field is validated (a wrong value raises ConfigError naming the field).
config = TrainConfig(
    name="api-example",
    algo="grpo",                       # any name in sara.algos.ALGOS: grpo, rloo, ppo, reinforce_pp, ...
    allocator="sara_paper:tau_low=0.45",     # any spec for sara.allocators.make_allocator: uniform, ds, sara:...
    groups_per_step=32,                # committed groups per step (the training batch, in groups of up to k)
    k=8,
    steps=10,
    eval={"every": 5, "num_prompts": 200},
    out_dir="runs/api-example",
    progress=False,
)

# 2. Trainer: builds the task, the tiny policy (warm-started, cached), its backend, allocator, sampler, optimizer.
with Trainer(config) as trainer:
    print("held-out accuracy before:", trainer.evaluate()["eval/acc_sample"])

    # 3. A few steps, by hand: each is collect -> advantages -> loss -> optimizer -> weight sync -> metrics.
    for _ in range(config.steps):
        m = trainer.train_step()
        print(f"step {trainer.step:2d}  rollouts {m['alloc/rollouts']:5.0f}  "
              f"effective {m['alloc/effective_groups']:3.0f}/{m['alloc/committed_groups']:.0f}  "
              f"reward {m['env/reward_mean']:.3f}  loss {m['algo/loss']:+.4f}  "
              f"collect {m['time/collect']:.2f}s  update {m['time/update']:.2f}s")

    # 4. Metrics after training (Trainer.train() does all of this plus JSONL, plots and checkpoints).
    print("held-out accuracy after: ", trainer.evaluate()["eval/acc_sample"])
    print(trainer.summary())
