"""THE training step: collect -> advantages -> loss -> optimizer step(s) -> weight sync -> metrics.

``Trainer(TrainConfig(...))`` wires a task, a policy (``sara.policies.POLICIES``), a generation backend
(``sara.policies.BACKENDS``), an allocator (``sara.allocators.make_allocator``), a prompt sampler and an algorithm
(``sara.algos.ALGOS``) together; ``train_step`` is one step, readable top to bottom; ``train`` loops, evaluates,
checkpoints and plots. Nothing here branches on the algorithm's or the allocator's name.

Counters kept separately (an LR schedule follows optimizer steps, never generation rounds or training steps):
``step`` (training steps = collection steps), ``optimizer_steps`` (mini-batch updates), ``version`` (weight syncs to
the generator), and cumulative rollouts / tokens.

Example:
    >>> cfg = TrainConfig(steps=3, groups_per_step=8)          # doctest: +SKIP
    >>> trainer = Trainer(cfg)                                  # doctest: +SKIP
    >>> metrics = trainer.train_step()                          # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from sara.allocators.posteriors import fit_beta_marginal_likelihood, p_effective
from sara.config import ConfigError, SaraModel, parse_spec, validate_config
from sara.envs.backends.ray_pool import RayTrainOptions
from sara.types import Decision

__all__ = ["TrainConfig", "OptimConfig", "EvalConfig", "Trainer", "RunSummary", "load_config", "apply_overrides"]


# ---------------------------------------------------------------------------------------------------------- configs
class OptimConfig(SaraModel):
    """Optimizer and schedule (AdamW). Every count here is in optimizer steps."""

    lr: float = Field(2e-4, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this (None = no clipping)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warmup: constant, or linear / cosine decay to 0 at ``total_optimizer_steps``."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup, in optimizer steps."""
    total_optimizer_steps: int | None = Field(None, ge=1)
    """Horizon of the decay schedules (None = steps x epochs x mini-batches per batch, estimated from the config)."""
    epochs: int | None = Field(None, ge=1)
    """Passes over each collected batch (None = the algorithm's suggestion, ``AlgoSpec.epochs``)."""
    minibatch_rollouts: int | None = Field(None, ge=1)
    """Rollouts per optimizer step (None = the whole batch: one optimizer step per epoch)."""


class EvalConfig(SaraModel):
    """Held-out evaluation (the task's ``eval_prompts``) with fixed seeds, so evaluations are comparable."""

    every: int = Field(10, ge=0)
    """Evaluate every this many training steps (0 = only before training and at the end)."""
    num_prompts: int = Field(500, ge=1)
    """Held-out prompts used (the first ones of the task's eval split)."""
    samples: int = Field(4, ge=1)
    """Sampled completions per prompt at the training temperature (``eval/acc_sample``)."""
    greedy: bool = True
    """Also report greedy accuracy (``eval/acc_greedy``)."""


class TrainConfig(SaraModel):
    """A training run. The defaults are ``sara train``'s embedded run: GRPO + SARA on the tiny policy and
    ``sara/Arithmetic-v0`` (a few minutes on 2 CPU cores)."""

    name: str = "grpo-sara-arithmetic"
    """Run name (the default output directory is ``runs/<name>``)."""
    seed: int = Field(0, ge=0)
    """Seed of rollouts, prompt order and mini-batch order."""
    task: str = "sara/Arithmetic-v0:max_digits=2,ops=+,pool_size=5000"
    """Task id or spec, see ``sara.envs.tasks``. Default: additions of 1- and 2-digit numbers (mixed widths, with and
    without carries: a wide spread of per-prompt difficulty for the warm-started tiny policy)."""
    policy: str = "tiny"
    """Policy factory name in ``sara.policies.POLICIES`` (or ``"module:attr"``)."""
    policy_options: dict[str, Any] = Field(default_factory=dict)
    """Options for the policy factory (tiny: ``TinyConfig`` fields and ``warm_start``)."""
    backend: str = "tiny"
    """Generation backend factory name in ``sara.policies.BACKENDS`` (or ``"module:attr"``)."""
    backend_options: dict[str, Any] = Field(default_factory=dict)
    """Options for the backend factory."""
    ray: RayTrainOptions = Field(default_factory=RayTrainOptions)
    """Distributed rollouts: ``ray.enabled`` runs ``ray.num_workers`` copies of the backend on Ray actors
    (``sara train --ray --num-workers N [--ray-address ADDR]``; see docs/ray.md)."""
    algo: str = "grpo"
    """Algorithm spec, e.g. ``"grpo"``, ``"ppo:lam=0.95"`` (see ``sara.algos.ALGOS``)."""
    allocator: str = "sara"
    """Allocator spec, e.g. ``"sara:tau_low=0.45"``, ``"ds"``, ``"uniform"`` (see ``sara.allocators``)."""
    sampler: str = "uniform"
    """Prompt sampler spec (see ``sara.allocators.SAMPLERS``)."""
    k: int = Field(8, ge=2)
    """Group size (rollouts per prompt when a group is complete)."""
    groups_per_step: int = Field(32, ge=1)
    """Committed groups wanted per step (the training batch, in groups)."""
    max_rollouts_per_step: int | None = Field(None, ge=1)
    """Hard rollout budget of one step (None = none)."""
    rollout_budget: int | None = Field(None, ge=1)
    """Rollouts for the whole run; training stops when it is spent (None = run ``steps`` steps)."""
    steps: int = Field(80, ge=0)
    """Training (collection) steps at most."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of training rollouts and of ``eval/acc_sample``."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Generation cap (None = the task's suggestion)."""
    scorer: Literal["auto", "thread", "process", "inline"] = "auto"
    """How the verifier runs (see ``sara.envs.TaskEnv``)."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation."""
    checkpoint_every: int = Field(0, ge=0)
    """Write a checkpoint every this many steps (0 = only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    out_dir: str | None = None
    """Output directory (None = ``runs/<name>``)."""
    threads: int | None = Field(None, ge=1)
    """``torch.set_num_threads`` (None = leave torch's default)."""
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool | None = None
    """Write TensorBoard events (None = when installed)."""

    @model_validator(mode="after")
    def _check_specs(self) -> TrainConfig:
        for field in ("task", "algo", "allocator", "sampler"):
            try:
                parse_spec(getattr(self, field))
            except ConfigError as exc:
                raise ValueError(f"field '{field}': {exc}") from None
        return self

    @property
    def output_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("runs") / self.name


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key=value`` / ``a.b=value`` overrides (values parsed as YAML scalars) to a nested dict."""
    import yaml

    out = copy.deepcopy(data)
    for item in overrides:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. --set optim.lr=1e-4)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                value = float(value) if any(c in value.lower() for c in ".e") else value
            except ValueError:
                pass
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: field '{p}' is not a section")
            node = nxt
        node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                base: Mapping[str, Any] | None = None) -> TrainConfig:
    """A ``TrainConfig`` from an optional YAML/JSON file and ``key=value`` overrides (errors name the field)."""
    import yaml

    data: dict[str, Any] = dict(base or {})
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config {path}: expected a mapping of TrainConfig fields at the top level")
        data.update(loaded)
    data = apply_overrides(data, overrides)
    return validate_config(TrainConfig, data, what="train config")


# ------------------------------------------------------------------------------------------------------ helpers
class _PhaseTimer:
    """Named wall-clock timers: ``with timer("collect"): ...`` -> ``{"time/collect": seconds}``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


@dataclass
class _Batch:
    """The committed rollouts as padded tensors (``N`` rollouts, ``T`` full length, ``R`` response length)."""

    tokens: Any  # TokenBatch over prompt + response [N, T]
    resp_index: Any  # [N, R] positions of response tokens in the full sequence
    response_mask: Any  # [N, R]
    rewards: Any  # [N]
    group_ids: Any  # [N]
    gen_logprobs: Any  # [N, R] log-probs reported by the generator


@dataclass
class RunSummary:
    """What a run achieved (``sara train`` prints it; ``sara matrix`` tabulates it)."""

    name: str
    algo: str
    allocator: str
    steps: int
    acc_before: float
    acc_after: float
    greedy_before: float | None
    greedy_after: float | None
    rollouts: int
    tokens: int
    effective_groups: int
    committed_groups: int
    p_mixed: float
    ds_rollouts_estimate: float
    wall_seconds: float
    out_dir: str
    abandoned_tokens: int = 0
    """Tokens generated for units the allocator abandoned (spent without reaching the batch)."""
    ds_tokens_estimate: float = float("nan")
    """Tokens DS would have generated: ``ds_rollouts_estimate`` x this run's mean tokens per rollout."""

    @property
    def effective_fraction(self) -> float:
        return self.effective_groups / self.committed_groups if self.committed_groups else 0.0


# ---------------------------------------------------------------------------------------------------------- trainer
class Trainer:
    """Runs ``TrainConfig``: build everything from registries, then ``train_step`` in a loop.

    Args:
        config: The run (a ``TrainConfig`` or a mapping of its fields).
        resume: Continue from the newest checkpoint in ``<out_dir>/checkpoints`` (fresh start when there is none).
        verbose: Print setup messages (warm start, resume).
    """

    def __init__(self, config: TrainConfig | Mapping[str, Any] | None = None, *, resume: bool = False,
                 verbose: bool = False) -> None:
        import torch

        from sara.algos import make_algo
        from sara.allocators import make_allocator, make_sampler
        from sara.envs.base import SamplingConfig
        from sara.envs.task_env import TaskEnv
        from sara.envs.tasks import make_task
        from sara.envs.tasks.scoring import BatchScorer
        from sara.envs.tree import TreeTaskEnv
        from sara.policies import BACKENDS, POLICIES

        cfg = config if isinstance(config, TrainConfig) else validate_config(TrainConfig, dict(config or {}),
                                                                              what="train config")
        self.config = cfg
        self.out_dir = cfg.output_dir
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.algo = make_algo(cfg.algo)
        self.task = make_task(cfg.task)
        if not self.task.eval_prompts:
            raise ConfigError(f"train config: field 'task': {cfg.task!r} has no held-out prompts to evaluate on")
        policy_factory = _lookup(POLICIES, cfg.policy, "policy")
        backend_factory = _lookup(BACKENDS, cfg.backend, "backend")
        if cfg.ray.enabled:  # ray.num_workers copies of the backend on Ray actors (sara.envs.backends.ray_pool)
            from sara.envs.backends.ray_pool import ray_backend_factory

            backend_factory = ray_backend_factory(backend_factory, cfg.ray)
        self.policy = policy_factory({**cfg.policy_options, **({"value_head": True} if self.algo.needs_critic else {})},
                                     task=self.task, seed=cfg.seed, verbose=verbose)
        if self.algo.needs_critic and not getattr(self.policy, "has_value_head", False):
            raise ConfigError(f"train config: field 'policy': algorithm {self.algo.name!r} needs a value head and "
                              f"policy {cfg.policy!r} has none")
        self.reference = None
        if self.algo.needs_reference:  # a frozen copy of the starting policy
            self.reference = copy.deepcopy(self.policy)
            for p in self.reference.parameters():
                p.requires_grad_(False)
        self.backend = backend_factory(self.policy, dict(cfg.backend_options), task=self.task, seed=cfg.seed)
        sampling = SamplingConfig(temperature=cfg.temperature,
                                  max_new_tokens=cfg.max_new_tokens or self.task.max_new_tokens or 64,
                                  stop=self.task.stop)
        mode = cfg.scorer if cfg.scorer != "auto" else ("thread" if self.task.thread_safe else "process")
        self.scorer = BatchScorer(self.task.verifier, mode=mode, timeout_s=self.task.timeout_s)  # shared by the envs
        self.allocator = make_allocator(cfg.allocator, k=cfg.k)
        # Tree allocators that send node handles need the environment that turns them into partial traces.
        env_cls = TreeTaskEnv if getattr(self.allocator.config, "node_prefix", False) else TaskEnv
        self.env = env_cls(self.task, self.backend, sampling, scorer=self.scorer)
        self.eval_env = TaskEnv(self.task, self.backend, sampling, split="eval", scorer=self.scorer)
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=sampling.max_new_tokens, stop=sampling.stop)
        self.greedy_env = TaskEnv(self.task, self.backend, greedy, split="eval", scorer=self.scorer)
        self.sampler = make_sampler(cfg.sampler, len(self.env.prompts), seed=cfg.seed, k=self.allocator.k)
        self.optimizer = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad],
                                           lr=cfg.optim.lr, betas=cfg.optim.betas,
                                           weight_decay=cfg.optim.weight_decay)
        self.epochs = cfg.optim.epochs or self.algo.epochs
        self.step = 0
        self.optimizer_steps = 0
        self.version = 0
        self.totals: dict[str, float] = defaultdict(float)  # cumulative rollouts, tokens, groups, p_mixed sums
        self.evals: list[dict[str, float]] = []
        self.wall_seconds = 0.0
        self.resumed_from: Path | None = None
        if resume:
            from sara.checkpoint import latest_checkpoint

            path = latest_checkpoint(self.out_dir / "checkpoints")
            if path is not None:
                self.load(path)
                if verbose:
                    print(f"resumed from {path} (step {self.step})", flush=True)

    # ---------------------------------------------------------------------------------------------- the step
    def train_step(self) -> dict[str, float]:
        """One step: collect -> advantages -> loss -> optimizer step(s) -> weight sync -> metrics."""
        from sara.collect import collect

        cfg, timer = self.config, _PhaseTimer()
        with timer("step"):
            # 1. Collect: the allocator decides who gets rollouts, the env generates + verifies in batched rounds.
            with timer("collect"):
                result = collect(self.allocator, self.env, self.sampler, target_groups=cfg.groups_per_step,
                                 max_rollouts=self._step_budget(), seed=cfg.seed, step=self.step)
            # 2. Advantages: rollout-time log-probs (old, reference), values, then the algorithm's estimator.
            with timer("advantages"):
                batch = self._make_batch(result.groups)
                adv_in, extra = self._advantage_inputs(batch) if batch is not None else (None, {})
                advantages, returns = self.algo.compute_advantages(adv_in) if adv_in is not None else (None, None)
            # 3-4. Loss and optimizer steps: `epochs` passes of shuffled mini-batches (optimizer steps counted).
            with timer("update"):
                algo_metrics = self._update(batch, advantages, returns, extra) if batch is not None else {}
            # 5. Weight sync: the generator samples the next step with the new weights.
            with timer("sync"):
                if batch is not None:
                    self.version += 1
                    self.backend.update_weights(self.policy.state_dict(), self.version)
            self.step += 1
            metrics = {**self._collect_metrics(result), **algo_metrics, **extra.get("metrics", {})}
        metrics.update(timer.metrics())
        return metrics

    # ------------------------------------------------------------------------------------------ the run loop
    def train(self, steps: int | None = None, *, log: bool = True) -> RunSummary:
        """Train until ``steps`` (default ``config.steps``) or the rollout budget is spent; evaluate, checkpoint,
        log JSONL (+ TensorBoard), plot; return a summary."""
        from sara.metrics import MetricsLogger, plot_learning_curves, read_jsonl

        cfg = self.config
        total = cfg.steps if steps is None else steps
        logger = MetricsLogger(self.out_dir, total_steps=total, progress=cfg.progress and log,
                               tensorboard=cfg.tensorboard if log else False,
                               resume_step=self.step if self.resumed_from is not None else None,
                               show={"acc": "eval/acc_sample", "reward": "env/reward_mean",
                                     "eff": "alloc/effective_fraction", "rollouts": "env/cum_rollouts"})
        try:
            if self.step == 0:
                ev = self.evaluate()
                logger.log(0, {**ev, **self._cumulative()})
            while self.step < total and not self.budget_spent():
                t0 = time.perf_counter()
                metrics = self.train_step()
                if (cfg.eval.every and self.step % cfg.eval.every == 0) or self.step >= total or self.budget_spent():
                    metrics.update(self.evaluate())
                metrics.update(self._cumulative())
                metrics["train/optimizer_steps"] = float(self.optimizer_steps)
                metrics["train/lr"] = self._lr()
                self.wall_seconds += time.perf_counter() - t0
                metrics["time/total"] = self.wall_seconds
                logger.log(self.step, metrics)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save()
            self.save()
        finally:
            logger.close()
        records = read_jsonl(logger.path)
        try:
            plot_learning_curves(records, self.out_dir / "learning_curve.png",
                                 title=f"{cfg.algo} + {cfg.allocator} on {cfg.task}")
        except ImportError:  # matplotlib is optional
            pass
        return self.summary(records)

    def budget_spent(self) -> bool:
        b = self.config.rollout_budget
        return b is not None and self.totals["rollouts"] >= b

    def _step_budget(self) -> int | None:
        caps = [c for c in (self.config.max_rollouts_per_step,
                            None if self.config.rollout_budget is None
                            else self.config.rollout_budget - int(self.totals["rollouts"])) if c is not None]
        return max(1, min(caps)) if caps else None

    # ------------------------------------------------------------------------------------------ batch building
    def _make_batch(self, groups: Sequence[Any]) -> _Batch | None:
        """Pad prompt + response tokens of the committed rollouts (grouped by id, any group size)."""
        import torch

        from sara.policies.base import TokenBatch

        rows = [(g.group_id, r) for g in groups for r in g.rollouts]
        if not rows:
            return None
        for _, r in rows:
            if r.token_ids is None or r.prompt_token_ids is None:
                raise RuntimeError("the backend must return prompt and completion token ids to train on them")
        lens_p = [len(r.prompt_token_ids) for _, r in rows]
        lens_r = [len(r.token_ids) for _, r in rows]
        n, t, big_r = len(rows), max(p + q for p, q in zip(lens_p, lens_r)), max(max(lens_r), 1)
        ids = torch.zeros(n, t, dtype=torch.long)
        attn = torch.zeros(n, t, dtype=torch.long)
        gen_lp = torch.zeros(n, big_r)
        for i, (_, r) in enumerate(rows):
            seq = list(r.prompt_token_ids) + list(r.token_ids)
            ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attn[i, : len(seq)] = 1
            if r.logprobs:
                gen_lp[i, : len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
        j = torch.arange(big_r)
        resp_index = (torch.tensor(lens_p)[:, None] + j).clamp(max=t - 1)
        resp_mask = (j[None, :] < torch.tensor(lens_r)[:, None]).float()
        full_mask = torch.zeros(n, t)
        full_mask.scatter_reduce_(1, resp_index, resp_mask, reduce="amax")  # clamped pad indices never unset a 1
        dev = _device(self.policy)
        tokens = TokenBatch(input_ids=ids.to(dev), attention_mask=attn.to(dev), response_mask=full_mask.to(dev))
        rewards = torch.tensor([r.reward for _, r in rows], dtype=torch.float32, device=dev)
        gids = torch.tensor([gid for gid, _ in rows], dtype=torch.long, device=dev)
        return _Batch(tokens, resp_index.to(dev), resp_mask.to(dev), rewards, gids, gen_lp.to(dev))

    def _response_logprobs(self, policy: Any, tokens: Any, resp_index: Any, *, with_entropy: bool = False
                           ) -> tuple[Any, Any]:
        """Log-probs (and entropy) of the response tokens, ``[N, R]``."""
        lp, ent = policy.token_logprobs(tokens, with_entropy=with_entropy)
        lp = lp.gather(1, resp_index)
        return lp, (ent.gather(1, resp_index) if ent is not None else None)

    def _advantage_inputs(self, b: _Batch) -> tuple[Any, dict[str, Any]]:
        """Rollout-time quantities (no gradient) and the algorithm's ``AdvantageInputs``."""
        import torch

        from sara.algos import AdvantageInputs

        with torch.no_grad():
            old_lp, _ = self._response_logprobs(self.policy, b.tokens, b.resp_index)
            ref_lp = (self._response_logprobs(self.reference, b.tokens, b.resp_index)[0]
                      if self.reference is not None else None)
            values = (self.policy.values(b.tokens).gather(1, b.resp_index) * b.response_mask
                      if self.algo.needs_critic else None)
        m = b.response_mask
        gen_gap = float(((old_lp - b.gen_logprobs).abs() * m).sum() / m.sum().clamp(min=1))
        extra = {"old_logprobs": old_lp, "ref_logprobs": ref_lp, "values": values,
                 "metrics": {"algo/gen_logprob_gap": gen_gap}}
        return AdvantageInputs(rewards=b.rewards, group_ids=b.group_ids, response_mask=m, values=values,
                               old_logprobs=old_lp, ref_logprobs=ref_lp), extra

    def _update(self, b: _Batch, advantages: Any, returns: Any, extra: Mapping[str, Any]) -> dict[str, float]:
        """``epochs`` passes of shuffled mini-batches; one optimizer step each. Returns mean ``algo/...`` metrics."""
        import torch

        from sara.algos import LossInputs

        cfg = self.config.optim
        n = b.rewards.shape[0]
        mb = cfg.minibatch_rollouts or n
        sums: dict[str, float] = defaultdict(float)
        count = 0
        want_entropy = True
        for epoch in range(self.epochs):
            order = np.random.default_rng([self.config.seed, self.step, epoch, 0x5EED]).permutation(n)
            for lo in range(0, n, mb):
                idx = torch.as_tensor(order[lo : lo + mb], device=b.rewards.device)
                tokens = _select(b.tokens, idx)
                lp, ent = self._response_logprobs(self.policy, tokens, b.resp_index[idx], with_entropy=want_entropy)
                values = (self.policy.values(tokens).gather(1, b.resp_index[idx]) if self.algo.needs_critic
                          else None)
                loss, m = self.algo.compute_loss(LossInputs(
                    logprobs=lp, advantages=advantages[idx], response_mask=b.response_mask[idx],
                    old_logprobs=extra["old_logprobs"][idx], ref_logprobs=_rows(extra["ref_logprobs"], idx),
                    entropy=ent, values=values, old_values=_rows(extra["values"], idx), returns=_rows(returns, idx),
                    group_ids=b.group_ids[idx]))
                self._set_lr()
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip is not None:
                    gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.grad_clip)
                    m["algo/grad_norm"] = float(gn)
                self.optimizer.step()
                self.optimizer_steps += 1
                for key, v in m.items():
                    sums[key] += v
                count += 1
        out = {k: v / count for k, v in sums.items()}
        out["algo/optimizer_steps"] = float(count)
        adv_m = advantages[b.response_mask > 0]
        out["algo/adv_abs_mean"] = float(adv_m.abs().mean()) if adv_m.numel() else 0.0
        return out

    def _lr(self) -> float:
        cfg = self.config.optim
        s = self.optimizer_steps
        if cfg.warmup_steps and s < cfg.warmup_steps:
            return cfg.lr * (s + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return cfg.lr
        horizon = cfg.total_optimizer_steps or self._estimated_optimizer_steps()
        frac = min(1.0, (s - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps))
        if cfg.schedule == "linear":
            return cfg.lr * (1.0 - frac)
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * frac))

    def _estimated_optimizer_steps(self) -> int:
        c = self.config
        per_batch = math.ceil(c.groups_per_step * c.k / c.optim.minibatch_rollouts) if c.optim.minibatch_rollouts else 1
        return max(1, c.steps * self.epochs * per_batch)

    def _set_lr(self) -> None:
        lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------------------------------------------ metrics
    def _collect_metrics(self, result: Any) -> dict[str, float]:
        """``alloc/...`` accounting of the step, ``env/...`` rewards, and the running P(mixed) estimate."""

        st = result.stats
        out = st.as_metrics("alloc/")
        out["alloc/effective_fraction"] = st.effective_groups / st.committed_groups if st.committed_groups else 0.0
        all_groups = [*result.groups, *result.abandoned, *result.discarded]
        rewards = np.concatenate([g.rewards for g in all_groups]) if all_groups else np.zeros(0)
        committed = np.concatenate([g.rewards for g in result.groups]) if result.groups else np.zeros(0)
        out["env/reward_mean"] = float(rewards.mean()) if len(rewards) else 0.0
        out["env/reward_committed"] = float(committed.mean()) if len(committed) else 0.0
        out["env/group_size_mean"] = float(np.mean([g.size for g in result.groups])) if result.groups else 0.0
        record_units(self.totals, all_groups, self.config.k)  # for the P(mixed) estimate behind the DS comparison
        t = self.totals
        t["rollouts"] += st.rollouts
        t["tokens"] += st.tokens
        t["abandoned_tokens"] += st.abandoned_tokens
        t["committed_groups"] += st.committed_groups
        t["effective_groups"] += st.effective_groups
        return out

    def _p_mixed(self) -> float:
        return estimate_p_mixed(self.totals, self.config.k)

    def _cumulative(self) -> dict[str, float]:
        t = self.totals
        p_mixed = self._p_mixed()
        return {"env/cum_rollouts": t["rollouts"], "env/cum_tokens": t["tokens"],
                "env/cum_abandoned_tokens": t["abandoned_tokens"],
                "env/cum_effective_groups": t["effective_groups"], "env/cum_committed_groups": t["committed_groups"],
                "env/p_mixed_estimate": p_mixed, "train/step": float(self.step),
                "train/weights_version": float(self.version)}

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy with fixed seeds: ``eval/acc_sample`` (training temperature) and ``eval/acc_greedy``."""
        from sara.seeding import derive_seeds
        from sara.types import RolloutRequest

        ec = self.config.eval
        t0 = time.perf_counter()
        prompts = list(self.eval_env.prompts[: ec.num_prompts])
        seeds = derive_seeds(self.config.seed, 0xE7A1, np.arange(len(prompts))[:, None], np.arange(ec.samples)[None])
        reqs = [RolloutRequest(unit_id=i, pool_index=i, prompt=p, seeds=tuple(int(x) for x in seeds[i]))
                for i, p in enumerate(prompts)]
        per_prompt = np.array([[r.reward for r in rs] for rs in self.eval_env.rollout(reqs)]).mean(1)
        out = {"eval/acc_sample": float(per_prompt.mean()),
               "eval/frac_prompts_mixed": float(((per_prompt > 0) & (per_prompt < 1)).mean()),
               "eval/frac_prompts_solved": float((per_prompt == 1).mean()),
               "eval/frac_prompts_unsolved": float((per_prompt == 0).mean())}
        if ec.greedy:
            reqs = [RolloutRequest(unit_id=i, pool_index=i, prompt=p, seeds=(0,)) for i, p in enumerate(prompts)]
            out["eval/acc_greedy"] = float(np.mean([rs[0].reward for rs in self.greedy_env.rollout(reqs)]))
        out["time/eval"] = time.perf_counter() - t0
        self.evals.append({"step": float(self.step), **out})
        return out

    def summary(self, records: Sequence[Mapping[str, Any]] | None = None) -> RunSummary:
        """Before/after accuracy (from the JSONL records when given), rollouts, tokens, and the DS estimate."""
        evals = [r for r in (records or self.evals) if "eval/acc_sample" in r]
        first, last = (evals[0], evals[-1]) if evals else ({}, {})
        t = self.totals
        p_mixed = self._p_mixed()
        ds = t["effective_groups"] * self.config.k / p_mixed if p_mixed > 0 else float("nan")
        return RunSummary(
            name=self.config.name, algo=self.config.algo, allocator=self.config.allocator, steps=self.step,
            acc_before=float(first.get("eval/acc_sample", float("nan"))),
            acc_after=float(last.get("eval/acc_sample", float("nan"))),
            greedy_before=first.get("eval/acc_greedy"), greedy_after=last.get("eval/acc_greedy"),
            rollouts=int(t["rollouts"]), tokens=int(t["tokens"]), effective_groups=int(t["effective_groups"]),
            committed_groups=int(t["committed_groups"]), p_mixed=p_mixed, ds_rollouts_estimate=ds,
            wall_seconds=self.wall_seconds, out_dir=str(self.out_dir), abandoned_tokens=int(t["abandoned_tokens"]),
            ds_tokens_estimate=ds * t["tokens"] / t["rollouts"] if t["rollouts"] else float("nan"))

    # --------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run bit for bit."""
        from sara.checkpoint import rng_state

        return {
            "config": self.config.model_dump(mode="json"),
            "counters": {"step": self.step, "optimizer_steps": self.optimizer_steps, "version": self.version,
                         "wall_seconds": self.wall_seconds},
            "totals": dict(self.totals),
            "evals": list(self.evals),
            "policy": {k: v.detach().cpu().clone() for k, v in self.policy.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "allocator": self.allocator.state_dict(),
            "sampler": self.sampler.state_dict(),
            "rng": rng_state(),
        }

    def save(self) -> Path:
        """Write ``<out_dir>/checkpoints/ckpt-<step>.pt`` atomically and prune old ones."""
        from sara.checkpoint import checkpoint_path, prune_checkpoints, save_checkpoint

        path = save_checkpoint(self.state_dict(), checkpoint_path(self.out_dir / "checkpoints", self.step))
        prune_checkpoints(self.out_dir / "checkpoints", self.config.keep_checkpoints)
        return path

    def load(self, path: str | Path) -> None:
        """Restore a checkpoint written by ``save`` and push its weights to the generator."""
        from sara.checkpoint import load_checkpoint, set_rng_state

        state = load_checkpoint(path)
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.allocator.load_state_dict(state["allocator"])
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        c = state["counters"]
        self.step, self.optimizer_steps, self.version = int(c["step"]), int(c["optimizer_steps"]), int(c["version"])
        self.wall_seconds = float(c.get("wall_seconds", 0.0))
        self.totals = defaultdict(float, state["totals"])
        self.evals = list(state.get("evals", []))
        if self.version > 0:
            self.backend.update_weights(self.policy.state_dict(), self.version)
        self.resumed_from = Path(path)

    def close(self) -> None:
        """Stop verifier workers and the backend."""
        for env in (self.env, self.eval_env, self.greedy_env):
            env.close()
        self.scorer.close()
        self.backend.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lookup(registry: Any, name: str, what: str) -> Any:
    try:
        return registry.get(name)
    except KeyError as exc:
        raise ConfigError(f"train config: field '{what}': {exc.args[0]}") from None


def _device(policy: Any) -> Any:
    return next(iter(policy.parameters())).device


def _rows(x: Any, idx: Any) -> Any:
    return None if x is None else x[idx]


def _select(tokens: Any, idx: Any) -> Any:
    from sara.policies.base import TokenBatch

    return TokenBatch(tokens.input_ids[idx], tokens.attention_mask[idx], tokens.response_mask[idx])


def default_threads() -> int:
    """Threads for torch: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def record_units(totals: dict[str, float], groups: Sequence[Any], k: int) -> None:
    """Count every closed unit's ``(n, s, effective)`` into ``totals`` (flat float keys ``ns/<n>/<s>/<eff>``)."""
    for g in groups:
        n_g = min(g.size, k)
        s_g = min(int(np.rint(g.rewards[:n_g].sum())), n_g)
        eff = int(g.decision == Decision.COMMIT and g.is_effective())
        totals[f"ns/{n_g}/{s_g}/{eff}"] = totals.get(f"ns/{n_g}/{s_g}/{eff}", 0.0) + 1.0


def estimate_p_mixed(totals: Mapping[str, float], k: int) -> float:
    """P(a fresh prompt's full size-k group is mixed), for the 'what DS would have spent' estimate.

    Units observed to be effective count 1; every other closed unit (abandoned, discarded, saturated) counts its
    posterior-predictive p_eff under a Beta prior fitted by marginal likelihood to ALL closed units' (n, s) — valid
    because the stopping rule depends only on observed outcomes. (The allocator's own uniform prior would credit a
    prompt abandoned after 4 failures with a 44% chance of mixing, whatever the population.)
    """
    rows = [(*map(int, key.split("/")[1:]), c) for key, c in totals.items() if key.startswith("ns/")]
    if not rows:
        return 0.0
    n, s, eff, c = (np.array(x, dtype=np.float64) for x in zip(*rows))
    a, b = fit_beta_marginal_likelihood(n, s, weights=c)
    p = np.where(eff > 0, 1.0, p_effective(n, s, k, a, b))
    return float(np.sum(c * p) / np.sum(c))
