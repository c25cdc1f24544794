"""``sara bench learner``: update seconds per trained rollout of the shipped learner against the naive path, and the
FLOP/s it reaches against this machine's measured matmul rate, in ONE run.

One batch of real rollouts (``groups`` prompts of ``task`` x ``k`` completions from the HF backend, scored by the
task's verifier) is trained on with two paths over the same weights, interleaved ``reps`` times:

* **naive**: the learner before the fast path: a float32 forward of every row's whole sequence with the vocabulary
  projection at every position, once without gradient for the old log-probs and once with gradient for the loss,
  then one AdamW step;
* **shipped**: ``Learner.advantages`` + ``Learner.update`` as ``sara train`` runs them (micro-batches under
  ``microbatch_tokens``, the shared prompt prefix forwarded once, logits at response positions only, old log-probs
  from the update's own forward, matmuls in ``compute_dtype``).

``naive=False`` times the shipped path alone (the naive path's full-vocabulary float32 logits need about
``rows x positions x vocabulary x 8`` bytes per forward, beyond a small machine's memory at reasoning length); the
report's ``naive`` and ``speedup`` are then None. ``options_from_train_config`` takes the batch of a ``sara train``
config (its model, task, groups per step, ``k``, generation cap, compute dtype, micro-batch budget, algorithm,
learning rate and seed), so the bench measures the update that run makes.

Seconds of a path are the median over reps of one whole update (forwards, backward, optimizer step); ``speedup`` is
naive ÷ shipped median seconds per rollout. The machine's matmul rate is measured in the same run, square matmuls of
up to ``matmul_size`` in float32 and in bfloat16 before every rep (the best of all, ``matmul_gflops``: an emulated
dtype on smaller matrices, so its rate costs seconds, not minutes). FLOPs count the
matmuls a path runs (``2 x params`` per position through the decoder's weight matrices, ``2 x V x D`` per position
through the LM head, the attention scores; a backward is twice its forward). ``needed`` counts only what the shipped
plan cannot avoid (each micro-batch's shared prefix once, every row's real tokens after it, the LM head at real
response tokens); ``limit_seconds`` = needed FLOPs at the best bfloat16 (``compute_dtype`` float32: float32) rate,
and ``over_limit`` = the shipped path's fastest update ÷ ``limit_seconds`` (both best cases, so load on a shared
machine inflates neither). ``memory`` (Linux): the resident size after the warm-up rep (weights, optimizer state,
the batch) and the peak resident size over the timed reps (``sara.memory.reset_peak_rss`` before them); None
where the peak cannot be reset.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field

from sara.commands.counts import MAX_BATCH, MAX_GROUP, MAX_SEEDS, MAX_TOKENS
from sara.config import MAX_SEED, SaraModel
from sara.train.flops import matmul_gflops

__all__ = ["LearnerBenchConfig", "format_table", "matmul_gflops", "options_from_train_config", "run_learner_bench"]


class LearnerBenchConfig(SaraModel):
    """Options of ``sara bench learner``."""

    model: str = "smollm2"
    """A prepared model name or a local HF model directory (the trained policy, float32 weights)."""
    task: str = "sara/Arithmetic-v0:max_digits=1,ops=+,pool_size=60,eval_size=37,shots=3"
    """Task spec whose first ``groups`` prompts are trained on (default: 3-shot 1-digit sums)."""
    groups: int = Field(8, ge=1, le=MAX_BATCH)
    """Prompts in the batch."""
    k: int = Field(8, ge=1, le=MAX_GROUP)
    """Completions per prompt."""
    max_new_tokens: int = Field(6, ge=1, le=MAX_TOKENS)
    """Generation cap of the completions."""
    reps: int = Field(3, ge=1, le=MAX_SEEDS)
    """Timed updates per path (interleaved, after one untimed warm-up of each)."""
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The shipped path's ``HFPolicyConfig.compute_dtype`` (``auto``: bfloat16 where this CPU has it natively)."""
    microbatch_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] | None = "auto"
    """The shipped path's ``OptimConfig.microbatch_tokens`` (``auto``: sized from the model and this machine's
    memory, as a run sizes it)."""
    algo: str = "grpo"
    """Algorithm spec of both paths."""
    lr: float = Field(3e-5, gt=0)
    """AdamW learning rate of both paths."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    """Seed of the completions."""
    matmul_size: int = Field(2048, ge=64)
    """Side of the square matmuls that measure the machine's rate."""
    naive: bool = True
    """Time the naive path too (False: the shipped path alone; ``naive`` and ``speedup`` are None)."""


def options_from_train_config(config: Any) -> dict[str, Any]:
    """``LearnerBenchConfig`` fields for the batch a ``TrainConfig`` trains on (model, task, groups per step, ``k``,
    generation cap, compute dtype, micro-batch budget, algorithm, learning rate, seed).

    Raises:
        ConfigError: the config's policy is not ``hf`` (the bench times an HF model's update).
    """
    from sara.config import ConfigError

    if config.policy != "hf":
        raise ConfigError(f"bench learner: the config's policy is {config.policy!r}; it times an HF model's update "
                          "(policy: hf)")
    opts = config.policy_options
    return {"model": str(opts.get("model", "smollm2")), "task": config.task, "groups": config.groups_per_step,
            "k": config.k, "max_new_tokens": config.max_new_tokens,
            "compute_dtype": str(opts.get("compute_dtype", "auto")),
            "microbatch_tokens": config.optim.microbatch_tokens, "algo": config.algo, "lr": config.optim.lr,
            "seed": config.seed}


def run_learner_bench(cfg: LearnerBenchConfig, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run the benchmark; return the JSON report (see the module docstring)."""
    import torch

    from sara.algos import make_algo
    from sara.memory import reset_peak_rss, rss_mb, window_peak_mb
    from sara.policies.hf import HFPolicy
    from sara.train import Learner, OptimConfig

    naive_policy = HFPolicy(cfg.model, compute_dtype="float32")
    module, tokenizer = naive_policy.model, naive_policy.tokenizer
    shipped_policy = HFPolicy(module, tokenizer, compute_dtype=cfg.compute_dtype)  # the same weights
    algo = make_algo(cfg.algo)
    groups = _rollouts(cfg, naive_policy, log)
    learner = Learner(shipped_policy, algo, OptimConfig(lr=cfg.lr, microbatch_tokens=cfg.microbatch_tokens))
    naive_opt = torch.optim.AdamW(list(module.parameters()), lr=cfg.lr)
    batch = learner.make_batch(groups)
    seconds: dict[str, list[float]] = {"naive": [], "shipped": []}

    def shipped() -> None:
        learner.update(batch, *learner.advantages(batch), step=0)

    def naive() -> None:
        _naive_update(naive_policy, algo, naive_opt, batch)

    rates = {"float32": 0.0, "bfloat16": 0.0}
    paths = (("naive", naive), ("shipped", shipped)) if cfg.naive else (("shipped", shipped),)
    memory: dict[str, float] | None = None
    for rep in range(cfg.reps + 1):  # rep 0 warms both up
        if rep == 1 and reset_peak_rss():  # the timed updates' peak, the optimizer state already allocated
            memory = {"resting_mb": rss_mb()}
        for dtype in rates:
            rates[dtype] = max(rates[dtype], matmul_gflops(cfg.matmul_size, getattr(torch, dtype), reps=3))
        for name, fn in paths:
            t0 = time.perf_counter()
            fn()
            if rep:
                seconds[name].append(time.perf_counter() - t0)
                log(f"rep {rep} {name}: {seconds[name][-1]:.2f} s")
    if memory is not None:
        memory["update_peak_mb"] = window_peak_mb()
    flops = _flops(module, learner, batch)
    n = len(batch.rewards)
    tokens = int(batch.tokens.attention_mask.sum())
    limit_dtype = "bfloat16" if shipped_policy.autocast_dtype is not None else "float32"
    limit = flops["needed"] / (rates[limit_dtype] * 1e9)
    report: dict[str, Any] = {"config": cfg.model_dump(), "rollouts": n, "tokens": tokens,
                              "response_tokens": int(batch.response_mask.sum()), "matmul_gflops": rates,
                              "flops": flops, "limit_dtype": limit_dtype, "limit_seconds": limit, "memory": memory,
                              "microbatch": {"tokens": learner.microbatch_tokens, "reason": learner.microbatch_reason}}
    report["naive"] = None
    for name, _ in paths:
        s = statistics.median(seconds[name])
        report[name] = {"seconds": s, "seconds_min": min(seconds[name]), "seconds_all": seconds[name],
                        "seconds_per_rollout": s / n, "seconds_per_token": s / tokens, "gflops": flops[name] / s / 1e9,
                        "gflops_best": flops[name] / min(seconds[name]) / 1e9}
    report["speedup"] = (report["naive"]["seconds_per_rollout"] / report["shipped"]["seconds_per_rollout"]
                         if cfg.naive else None)
    report["over_limit"] = report["shipped"]["seconds_min"] / limit
    return report


def format_table(report: dict[str, Any]) -> str:
    """A short human-readable summary of ``run_learner_bench``'s report."""
    rates = report["matmul_gflops"]
    lines = [f"{report['rollouts']} rollouts, {report['tokens']} tokens ({report['response_tokens']} response); "
             f"matmul {rates['float32']:.0f} GFLOP/s float32, {rates['bfloat16']:.0f} GFLOP/s bfloat16"]
    for name in ("naive", "shipped"):
        r = report[name]
        if r is None:
            lines.append(f"{name:8s} not timed")
            continue
        lines.append(f"{name:8s} {r['seconds']:7.2f} s/update  {1e3 * r['seconds_per_rollout']:8.1f} ms/rollout  "
                     f"{1e3 * r['seconds_per_token']:6.2f} ms/token  {r['gflops']:6.0f} GFLOP/s")
    speedup = "n/a" if report["speedup"] is None else f"{report['speedup']:.2f}x (medians)"
    lines.append(f"speedup {speedup}; shipped at best {report['shipped']['seconds_min']:.2f} s = "
                 f"{report['over_limit']:.2f}x the {report['limit_dtype']} FLOP limit of the needed work "
                 f"({report['limit_seconds']:.2f} s)")
    if report.get("memory"):
        m = report["memory"]
        lines.append(f"memory: resident {m['resting_mb'] / 1024:.2f} GiB before the timed updates, "
                     f"{m['update_peak_mb'] / 1024:.2f} GiB at their peak")
    return "\n".join(lines)


def _rollouts(cfg: LearnerBenchConfig, policy: Any, log: Callable[[str], None]) -> list[Any]:
    """``groups`` committed groups of ``k`` real completions (HF backend, a copy of the policy's weights in the
    ``auto`` dtype)."""
    from sara.backends.hf import make_hf_backend
    from sara.envs.base import SamplingConfig
    from sara.envs.task_env import TaskEnv
    from sara.envs.tasks import make_task
    from sara.types import Decision, Group, RolloutRequest

    task = make_task(cfg.task)
    backend = make_hf_backend(policy, {"max_batch_size": cfg.groups * cfg.k})  # dtype auto (sara.machine)
    env = TaskEnv(task, backend, SamplingConfig(max_new_tokens=cfg.max_new_tokens, stop=task.stop))
    try:
        prompts = env.prompts[: cfg.groups]
        t0 = time.perf_counter()
        out = env.rollout([RolloutRequest(unit_id=i, pool_index=i, prompt=p,
                                          seeds=tuple(range(cfg.seed + i * cfg.k, cfg.seed + (i + 1) * cfg.k)))
                           for i, p in enumerate(prompts)])
        log(f"generated {cfg.groups} x {cfg.k} completions in {time.perf_counter() - t0:.1f} s")
    finally:
        env.close()
        backend.close()
    return [Group(group_id=i, prompt=p, pool_index=i, rollouts=tuple(rs), decision=Decision.COMMIT)
            for i, (p, rs) in enumerate(zip(prompts, out))]


def _naive_update(policy: Any, algo: Any, optimizer: Any, b: Any) -> None:
    """The update before the fast path: full-sequence float32 forwards (no-grad old log-probs, then with gradient),
    the loss over the whole batch, one AdamW step."""
    import torch

    from sara.algos import AdvantageInputs, LossInputs

    def logprobs() -> Any:
        return policy.score(b.tokens).logprobs.gather(1, b.resp_index)

    with torch.no_grad():
        old = logprobs()
    adv, _ = algo.compute_advantages(AdvantageInputs(rewards=b.rewards, group_ids=b.group_ids,
                                                     response_mask=b.response_mask, old_logprobs=old))
    loss, _ = algo.compute_loss(LossInputs(logprobs=logprobs(), advantages=adv, response_mask=b.response_mask,
                                           old_logprobs=old, group_ids=b.group_ids))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _flops(module: Any, learner: Any, b: Any) -> dict[str, float]:
    """Matmul FLOPs of one update: ``naive`` (two full forwards, one backward), ``shipped`` (the learner's plan) and
    ``needed`` (the plan without padding)."""
    from sara.train.flops import ModelFlops

    m = ModelFlops.of(module)
    lens = b.tokens.attention_mask.sum(1).tolist()
    n, t = b.tokens.input_ids.shape
    naive_fwd = n * (m.span(0, t) + t * m.head)  # every padded position, the LM head at each
    scored = b.response_mask.sum(1).tolist()
    given = learner.shared_length(b)  # forwarded once per update, its keys / values given to every micro-batch
    shipped = needed = 3 * m.span(0, given)
    for micro in learner._plan(b, given=given):
        p, w, rows = micro.prefix, micro.width, micro.rows.tolist()
        pre = m.span(given, p)
        shipped += 3 * (pre + len(rows) * m.span(p, w) + sum(scored[i] for i in rows) * m.head)
        needed += 3 * (pre + sum(m.span(p, lens[i]) + scored[i] * m.head for i in rows))
    if learner.algo.needs_critic or learner.algo.kl_in_reward or not learner.single_pass(n):
        shipped += shipped / 3  # the rollout-time pass: one more forward without gradient
    return {"naive": 4 * naive_fwd, "shipped": shipped, "needed": needed}  # naive: 2 forwards + a 2x backward
