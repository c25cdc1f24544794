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
import time

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


def time_split(log_history: list[dict], env_metrics: dict, evals: list[dict], wall: float) -> dict[str, float]:
    """Where the run's seconds went: TRL's trainer thread (forward + backward, optimizer, weight sync, waiting for
    rollouts; summed from its ``perf/*_s`` logs) and the SARA worker's thread (generation and scoring in its env)."""
    def total(key: str) -> float:
        return float(sum(rec[key] for rec in log_history if key in rec))

    return {"wall": wall, "trainer_fwd_bwd": total("perf/fwd_bwd_s"), "trainer_optimizer": total("perf/optimizer_s"),
            "trainer_weight_sync": total("perf/weight_sync_s"), "trainer_waiting_for_rollouts": total("perf/rollout_wait_s"),
            "worker_generate": env_metrics.get("env/generate_seconds", 0.0),
            "worker_score": env_metrics.get("env/score_seconds", 0.0),
            "eval": float(sum(e.get("seconds_eval", 0.0) for e in evals))}


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
    ap.add_argument("--gen-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="generating copy's dtype (auto: bfloat16 where this CPU has it natively, else float32)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-dir", default="runs/trl_async_grpo")
    ap.add_argument("--json", default=None, help="write TRL's log history and the pushed group sizes here")
    ap.add_argument("--eval-prompts", type=int, default=0,
                    help="held-out prompts evaluated before training, every --eval-every steps and at the end (0 = off)")
    ap.add_argument("--eval-samples", type=int, default=2, help="sampled completions per held-out prompt")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every this many steps (0 = before and after only)")
    ap.add_argument("--queue-size", type=int, default=1024,
                    help="samples the worker may have waiting for the trainer (it pauses when full): how far ahead of "
                         "the trained weights it generates")
    ap.add_argument("--max-staleness", type=int, default=4, help="TRL drops samples this many weight versions old")
    ap.add_argument("--driver", default="rounds", choices=["rounds", "stream"],
                    help="the worker's driver: synchronous rounds, or streaming with carry-over (carry_lag=1)")
    args = ap.parse_args(argv)

    from transformers import TrainerCallback
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
    driver = None if args.driver == "rounds" else {"barrier": False, "carry_lag": 1}
    worker = SaraRolloutWorker(env, args.allocator, k=args.k, sampler=args.sampler,
                               target_groups=args.target_groups, seed=args.seed, driver=driver,
                               queue_maxsize=args.queue_size)
    eval_env = TaskEnv(task, backend, env.sampling, split="eval", scorer=env.scorer) if args.eval_prompts else None
    evals: list[dict] = []

    def evaluate(step: int) -> None:
        res = worker.evaluate(eval_env, num_prompts=args.eval_prompts, samples=args.eval_samples, seed=args.seed)
        evals.append({"step": step, "acc": res["eval/acc_sample"], "rollouts": worker.totals["rollouts"],
                      "seconds": time.perf_counter() - t0, "seconds_eval": res["time/eval"],
                      "weights_version": res["eval/weights_version"]})
        print(f"eval step {step}: held-out acc {res['eval/acc_sample']:.3f} after {worker.totals['rollouts']} rollouts, "
              f"{evals[-1]['seconds']:.0f} s", flush=True)

    class EvalCallback(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            if eval_env is not None and args.eval_every and state.global_step % args.eval_every == 0 \
                    and state.global_step < args.steps:
                evaluate(state.global_step)

    config = AsyncGRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, token_budget=0, max_staleness=args.max_staleness, weight_sync_steps=1, seed=args.seed,
        max_completion_length=args.max_new_tokens, heartbeat_stale_after_s=1800,
    )
    trainer = async_grpo_trainer(model_dir, worker, args=config)
    trainer.add_callback(EvalCallback())  # after TRL's own weight-sync callback: a step's eval sees its weights
    t0 = time.perf_counter()
    try:
        if eval_env is not None:
            evaluate(0)
        trainer.train()
        worker.stop()  # the backend holds the trainer's last weights (synced after every step)
        if eval_env is not None:
            evaluate(args.steps)
    finally:
        worker.stop()
        env_metrics = env.metrics()
        env.close()
        if eval_env is not None:
            eval_env.close()
    wall = time.perf_counter() - t0
    trained = sorted(trainer._trained_groups)
    out = {"log_history": trainer.state.log_history,
           "trained_group_sizes": [worker.pushed_groups[g] for g in trained],
           "pushed_group_sizes": list(worker.pushed_groups.values()),
           "backend_version": backend.version, "trainer_version": trainer.model_version,
           "eval": evals, "wall_seconds": wall, "rollouts": worker.totals["rollouts"],
           "seconds": time_split(trainer.state.log_history, env_metrics, evals, wall)}
    for rec in trainer.state.log_history:
        if "loss" in rec:
            sara_keys = {k: round(v, 3) for k, v in rec.items() if k.startswith("sara/") and v is not None}
            print(f"step {rec.get('step')}: loss={rec['loss']:.4f} reward={rec.get('reward')} {sara_keys}")
    print(f"groups trained: {len(trained)}, sizes {sorted(set(out['trained_group_sizes']))}; "
          f"weights version: trainer {trainer.model_version}, backend {backend.version}")
    print("seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in out["seconds"].items()))
    if evals:
        print(f"held-out acc {evals[0]['acc']:.3f} -> {evals[-1]['acc']:.3f} in {args.steps} steps, "
              f"{worker.totals['rollouts']} rollouts, {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, default=float)
    return out


if __name__ == "__main__":
    main()
