"""SARA inside TRL: ``AsyncGRPOTrainer`` trains SmolLM2-135M on CPU while a SARA allocator picks its rollouts.

Run (from the repository root; needs ``pip install -e ".[trl]"`` and the model, ``sara model prepare smollm2``):

    python examples/trl_async_grpo.py --steps 2

The rollout worker (``sara.integrations.trl_async.SaraRolloutWorker``) runs ``sara.collect`` with the allocator on a
``TaskEnv`` (the task's verifier on an HF generation backend holding its own copy of the policy); committed groups —
of any size: ``completion=as_is`` keeps SARA's variable-size groups — go to TRL's queue with GRPO advantages from
``sara.algos``; TRL trains on them and syncs its weights back into the backend after every step. TRL's loss and
SARA's ``sara/...`` metrics are printed per logging step.

The default task (``examples/ChatSum-v0``, defined below) asks for a sum of two numbers below 20 in a chat message:
SmolLM2-135M solves about 1 in 6 at temperature 1, so many groups are mixed. Any registered task works
(``--task sara/Countdown-v0``), but a task the model never solves commits no group and the trainer waits.
"""

from __future__ import annotations

import argparse
import json
import re

import numpy as np

from sara.envs.tasks import Task, register_task
from sara.types import Prompt


def verify_sum(completion: str, *, answer: int) -> float:
    """1.0 if the first integer in the completion is the sum (bounded read; no eval)."""
    m = re.search(r"-?\d{1,6}", completion[:200])
    return float(m is not None and int(m.group()) == int(answer))


def make_chat_sum_task(size: int = 300, eval_size: int = 50, seed: int = 0, high: int = 20) -> Task:
    rng = np.random.default_rng(seed)
    pairs = rng.integers(0, high, size=(size + eval_size, 2)).tolist()
    prompts = [Prompt(id=f"chatsum-{i:04d}", prompt=f"What is {a} + {b}? Reply with the number only.",
                      answer={"answer": a + b}) for i, (a, b) in enumerate(pairs)]
    return Task(id="examples/ChatSum-v0", prompts=prompts[eval_size:], eval_prompts=prompts[:eval_size],
                verifier=verify_sum, chat=True, max_new_tokens=8)


register_task("examples/ChatSum-v0", make_chat_sum_task, override=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (TRL max_steps)")
    ap.add_argument("--model", default="smollm2", help="prepared model name or local HF model directory")
    ap.add_argument("--task", default="examples/ChatSum-v0")
    ap.add_argument("--allocator", default="sara_paper:tau_low=0.45,completion=as_is")
    ap.add_argument("--sampler", default="uniform")
    ap.add_argument("--k", type=int, default=8, help="group size of the allocator (k=8, tau_low=0.45: abandon after 4 equal)")
    ap.add_argument("--target-groups", type=int, default=2, help="committed groups per SARA collect step")
    ap.add_argument("--batch-size", type=int, default=8, help="rollout samples per optimizer step")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--gen-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default="runs/trl_async_grpo")
    ap.add_argument("--json", default=None, help="write TRL's log history and the pushed group sizes here")
    args = ap.parse_args(argv)

    from trl.experimental.async_grpo import AsyncGRPOConfig

    from sara.backends.hf import HFBackend
    from sara.envs.base import SamplingConfig
    from sara.envs.task_env import TaskEnv
    from sara.envs.tasks import make_task
    from sara.hub import resolve_model
    from sara.integrations.trl_async import SaraRolloutWorker
    from sara.integrations.trl_trainer import async_grpo_trainer

    model_dir = resolve_model(args.model)  # a prepared name (prepared on first use) or an HF model directory
    task = make_task(args.task)
    backend = HFBackend(str(model_dir), dtype=args.gen_dtype, max_batch_size=64)
    env = TaskEnv(task, backend, SamplingConfig(max_new_tokens=args.max_new_tokens, stop=task.stop))
    worker = SaraRolloutWorker(env, args.allocator, k=args.k, sampler=args.sampler,
                               target_groups=args.target_groups, seed=args.seed)
    config = AsyncGRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, token_budget=0, max_staleness=4, weight_sync_steps=1, seed=args.seed,
        max_completion_length=args.max_new_tokens, heartbeat_stale_after_s=1800,
    )
    trainer = async_grpo_trainer(model_dir, worker, args=config)
    try:
        trainer.train()
    finally:
        env.close()
    trained = sorted(trainer._trained_groups)
    out = {"log_history": trainer.state.log_history,
           "trained_group_sizes": [worker.pushed_groups[g] for g in trained],
           "pushed_group_sizes": list(worker.pushed_groups.values()),
           "backend_version": backend.version, "trainer_version": trainer.model_version}
    for rec in trainer.state.log_history:
        if "loss" in rec:
            sara_keys = {k: round(v, 3) for k, v in rec.items() if k.startswith("sara/") and v is not None}
            print(f"step {rec.get('step')}: loss={rec['loss']:.4f} reward={rec.get('reward')} {sara_keys}")
    print(f"groups trained: {len(trained)}, sizes {sorted(set(out['trained_group_sizes']))}; "
          f"weights version: trainer {trainer.model_version}, backend {backend.version}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, default=float)
    return out


if __name__ == "__main__":
    main()
