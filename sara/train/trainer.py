"""THE training loop: collect -> advantages -> loss -> optimizer step(s) -> weight sync -> metrics, then eval and
checkpoints.

``Trainer(TrainConfig(...))`` wires a task, a policy (``sara.policies.POLICIES``), a generation backend
(``sara.backends.BACKENDS``), an allocator, a prompt sampler, an algorithm (``sara.algos.ALGOS``) and a ``Learner``
together; ``train_step`` is one step, readable top to bottom, each phase timed by name; ``train`` loops, evaluates,
checkpoints and plots. Nothing here branches on the algorithm's or the allocator's name.

Counters kept apart (an LR schedule follows optimizer steps): ``step`` (training = collection steps),
``learner.optimizer_steps`` (mini-batch updates), ``version`` (weight syncs), ``totals`` (rollouts, tokens, ...).

Example:
    >>> cfg = TrainConfig(steps=3, groups_per_step=8)          # doctest: +SKIP
    >>> trainer = Trainer(cfg)                                  # doctest: +SKIP
    >>> metrics = trainer.train_step()                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from sara.backends import BoundsKV, ReleasesStale
from sara.config import ConfigError, validate_config
from sara.metrics import OutcomeCounts
from sara.timing import PhaseTimer
from sara.train.bank import SurplusBank, batch_reward_variance
from sara.train.config import TrainConfig, default_threads
from sara.train.flops import FlopFloor
from sara.train.guards import VerifierHealth, check_finite, check_step_limit
from sara.train.learner import Learner, planned_optimizer_steps
from sara.train.microbatch import microbatch_line
from sara.train.progress import StepProgress
from sara.train.resume import check_resume
from sara.train.reweight import Advantages, weigh_advantages
from sara.train.rundir import RUN_MARKER, RunLock, releases_run_lock, run_writes, take_run_lock
from sara.train.summary import PHASES, RunSummary, cumulative_spend, note_peak, run_files, step_accounting
from sara.train.summary import summarize as summarize_run

__all__ = ["Trainer", "RunSummary", "default_threads"]


class Trainer:
    """Runs ``TrainConfig``: build everything from registries, then ``train_step`` in a loop.

    Args:
        config: The run (a ``TrainConfig`` or a mapping of its fields).
        resume: Continue from the newest checkpoint in ``<out_dir>/checkpoints`` (a run there without one: refused).
        verbose: Print setup messages (warm start, resume).
        run_lock: The held ``RunLock`` of ``out_dir`` when the caller claimed it (default: take one).
    """

    @releases_run_lock
    def __init__(self, config: TrainConfig | Mapping[str, Any] | None = None, *, resume: bool = False,
                 verbose: bool = False, run_lock: RunLock | None = None) -> None:
        import torch

        from sara.algos import make_algo
        from sara.allocators.sequential import SequentialAllocator
        from sara.backends import BACKENDS
        from sara.backends.embed import policy_embedder
        from sara.envs.base import SamplingConfig
        from sara.envs.task_env import pool_embedder
        from sara.envs.tasks import make_task
        from sara.envs.tasks.scoring import BatchScorer, scorer_mode
        from sara.policies import POLICIES
        from sara.priors.grouped import prompt_groups
        from sara.train.envs import make_envs
        from sara.train.resolve import allocation_config, build_run_allocation

        cfg = config if isinstance(config, TrainConfig) else validate_config(TrainConfig, dict(config or {}),
                                                                              what="train config")
        self.config = cfg
        self.out_dir = cfg.output_dir
        self._run_lock = take_run_lock(self.out_dir, run_lock, resume=resume)  # one run per directory, till close()
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.algo = make_algo(cfg.algo)
        self.task = make_task(cfg.task)
        mode = scorer_mode(cfg.scorer, self.task)  # a verifier that is not thread-safe runs in worker processes
        if not self.task.eval_prompts and verbose:
            print(f"sara: note: task {self.task.id!r} has no held-out prompts: no evaluation (eval/* metrics); hold "
                  "some out with the task option eval_size=N", file=sys.stderr, flush=True)
        policy_name, policy_options = cfg.component("policy")
        backend_name, backend_options = cfg.component("backend")
        policy_factory = POLICIES.factory(policy_name, what="train config: field 'policy'")  # kind-checked
        backend_factory = BACKENDS.factory(backend_name, what="train config: field 'backend'")
        if cfg.ray.enabled:  # ray.num_workers copies of the backend on Ray actors (sara.backends.ray)
            from sara.backends.ray.pool import ray_backend_factory

            backend_factory = ray_backend_factory(backend_factory, cfg.ray)
        self.policy = policy_factory({**policy_options, **({"value_head": True} if self.algo.needs_critic else {})},
                                     task=self.task, seed=cfg.seed, verbose=verbose)
        if self.algo.needs_critic and not self.policy.has_value_head:
            raise ConfigError(f"train config: field 'policy': algorithm {self.algo.name!r} needs a value head and "
                              f"policy {cfg.policy!r} has none")
        epochs = cfg.optim.epochs or self.algo.epochs
        self.learner = Learner(self.policy, self.algo, cfg.optim, seed=cfg.seed, horizon=planned_optimizer_steps(
            cfg.steps, cfg.groups_per_step, cfg.k, epochs, cfg.optim.minibatch_rollouts))
        if verbose:
            print(microbatch_line(self.learner.microbatch_tokens, self.learner.microbatch_reason), flush=True)
        self.floor = FlopFloor.of_policy(self.policy)  # the FLOPs the run's work cannot avoid (sara.train.flops)
        self.backend = backend_factory(self.policy, backend_options, task=self.task, seed=cfg.seed)
        if verbose and isinstance(self.backend, BoundsKV):
            print(self.backend.kv_line(), flush=True)
        sampling = SamplingConfig(temperature=cfg.temperature,
                                  max_new_tokens=cfg.max_new_tokens or self.task.max_new_tokens or 64,
                                  stop=self.task.stop)
        self.scorer = BatchScorer(self.task.verifier, mode=mode, timeout_s=self.task.timeout_s)  # shared by the envs
        self.env, self.eval_env, self.greedy_env = make_envs(cfg, self.task, self.backend, sampling, self.scorer,
                                                             allocation_config(cfg))
        self.verifier_health = VerifierHealth(self.env, self.task.verifier, cfg.max_verifier_failure_share)
        self.progress = StepProgress(lambda text, force=False: self._logger and self._logger.live(text, force=force))
        embed = pool_embedder(self.env, policy_embedder(self.policy), print if verbose else None)  # <embedding>
        built = build_run_allocation(cfg, self.env.prompts, embed)  # as --print-config resolves it (sara.train.resolve)
        self.allocator, self.sampler = built.allocator, built.sampler
        self.bank = SurplusBank(cfg.groups_per_step, cfg.surplus)  # committed groups beyond the batch (bank.py)
        self.step = self.version = 0  # steps taken; the policy's weights version (one per update)
        self.totals: dict[str, float] = defaultdict(float)  # cumulative rollouts, tokens, groups
        # Every closed unit's (group, n, s, effective): the DS estimate, fitted per group as the allocator's prior is.
        self.outcomes = OutcomeCounts(cfg.k, labels=prompt_groups(
            self.allocator.prior if isinstance(self.allocator, SequentialAllocator) else None))
        self.evals: list[dict[str, float]] = []
        self.wall_seconds = 0.0
        self.resumed_from: Path | None = None
        self.skipped_checkpoints: list[str] = []  # newer checkpoints --resume could not use, and why
        self.last_checkpoint: Path | None = None
        self._saved_step = -1
        self._logger: Any = None  # the open metrics log; its manifest goes into checkpoints, as do those of _files
        self._files: dict[str, Any] = {}  # what the loaded checkpoint or the last train() vouches for
        self._carry: Any = None  # streaming with carry_lag: what the last step handed on (never checkpointed)
        self._horizon = cfg.steps  # the running train() call's last step (no carry out of it)
        if resume:
            from sara.train.checkpoint import resume_checkpoint

            path, state, self.skipped_checkpoints = resume_checkpoint(self.out_dir / "checkpoints",
                                                                      check=lambda p, s: check_resume(self, p, s))
            for msg in self.skipped_checkpoints:
                print(f"sara: warning: {msg}; skipped it", file=sys.stderr, flush=True)
            if path is not None and state is not None:
                self.load_state_dict(state)
                self.resumed_from = self.last_checkpoint = path
                self._saved_step = self.step
                if verbose:
                    print(f"resumed from {path} (step {self.step})", flush=True)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer (mini-batch) updates so far."""
        return self.learner.optimizer_steps

    # ---------------------------------------------------------------------------------------------- the step
    def train_step(self) -> dict[str, float]:
        """One step: collect -> advantages -> loss -> optimizer step(s) -> weight sync -> metrics."""
        from sara.driver import collect

        cfg, timer, learner = self.config, PhaseTimer(memory=True), self.learner
        with timer("step"):
            # 1. Collect: the allocator decides who gets rollouts, the env generates + verifies them (in synchronous
            # rounds, or rollout by rollout on a streaming backend: sara.driver).
            with timer("collect"):
                result = collect(self.allocator, self.env, self.sampler, target_groups=self.bank.need(), driver=cfg.driver,
                                 max_rollouts=self._step_budget(), seed=cfg.seed, step=self.step, carry=self._carry,
                                 observers=[self.verifier_health, self.progress], policy_version=self.version,
                                 hand_on=self._hands_on())
                self._carry = result.carry
                health = self.verifier_health.end(result.stats.rollouts)  # a broken verifier stops here
                check_step_limit(result.stats, self.step, cfg)  # so does a step where nothing was effective
            # 2. Advantages: the batch (banked surplus + this step's groups), rollout-time log-probs (old, reference),
            # values, then the algorithm's estimator.
            with timer("advantages"):
                last = self.step + 1 >= self._horizon or self.budget_spent(pending=result.stats.rollouts)
                groups = self.bank.batch(result.groups, flush=last)
                batch = learner.make_batch(groups, version=self.version)
                advantages, returns, extra = learner.advantages(batch) if batch is not None else (None, None, {})
                advantages = weigh_advantages(self.allocator, groups, advantages, extra)  # sara:reweight=ds
            # 3-4. Loss and optimizer steps (`epochs` passes of mini-batches); the engine's prompt KV is stale from here
            with timer("update"):
                if isinstance(self.backend, ReleasesStale):  # freed before the update's peak, not after it
                    self.backend.release_stale()
                algo_metrics = (learner.update(batch, cast(Advantages, advantages), returns, extra, step=self.step)
                                if batch is not None else {})
                check_finite(self.step, algo_metrics, self.policy, cfg)  # before the weights go anywhere
            # 5. Weight sync: the generator samples the next step with the new weights.
            with timer("sync"):
                if batch is not None:
                    self.version += 1
                    self.backend.update_weights(self.policy.state_dict(), self.version)
            self.step += 1
            trained = float(batch.response_mask.sum()) if batch is not None else 0.0
            metrics = {**step_accounting(result, self.totals, self.outcomes, self.floor), **health,
                       **self.sampler.metrics(), **algo_metrics,
                       **extra.get("metrics", {}),
                       "train/batch_groups": float(len(groups)), "train/banked_groups": float(len(self.bank)),
                       "train/group_reward_var": batch_reward_variance(groups), "train/trained_tokens": trained}
            self.totals["trained_tokens"] += trained
            self.floor.add(self.totals, "update", self.floor.update((g.rollouts for g in groups), learner.epochs))
            self.totals["verifier_errors"] += health["env/verifier_errors"]
            self.totals["verifier_timeouts"] += health["env/verifier_timeouts"]
        metrics.update(timer.metrics())
        for phase in PHASES:
            self.totals[f"seconds_{phase}"] += metrics.get(f"time/{phase}", 0.0)
        self.wall_seconds += metrics["time/step"]  # so summary() is right when stepping by hand
        return metrics

    # ------------------------------------------------------------------------------------------ the run loop
    def train(self, steps: int | None = None, *, log: bool = True) -> RunSummary:
        """Train until ``steps`` (default ``config.steps``) or the rollout budget is spent; evaluate, checkpoint,
        log JSONL (+ TensorBoard), plot; return a summary.

        SIGINT / SIGTERM end the run after the running step with a final checkpoint (``interrupted`` names the signal);
        a checkpoint that cannot be written is a warning, any other file a one-line error (``rundir.run_writes``).
        """
        from sara.metrics import PROGRESS_FIELDS, MetricsLogger, plot_learning_curves, read_jsonl
        from sara.train.guards import StopSignals

        cfg = self.config
        total = self._horizon = cfg.steps if steps is None else steps
        with run_writes(self):
            logger = self._logger = MetricsLogger(
                self.out_dir, total_steps=total, progress=cfg.progress and log, resume=self._files.get(RUN_MARKER),
                tensorboard=cfg.tensorboard if log else False, initial_step=self.step, show=PROGRESS_FIELDS)
            with StopSignals() as stop:
                self._loop(total, logger, stop)
            with contextlib.suppress(ImportError):  # matplotlib is optional
                plot_learning_curves(read_jsonl(logger.path), self.out_dir / "learning_curve.png",
                                     title=f"{cfg.algo} + {cfg.allocator}"
                                     f"{'' if cfg.sampler.strip() == 'uniform' else '@' + cfg.sampler} on {cfg.task}")
        summary = self.summary()  # from the evaluations the trainer ran or its checkpoint carried
        summary.interrupted = stop.received
        summary.files = run_files(self.out_dir)
        return summary

    def _loop(self, total: int, logger: Any, stop: Any) -> None:
        cfg, learner = self.config, self.learner
        try:
            if self.step == 0:
                logger.log(0, {**self.evaluate(), **self._cumulative()})
            while self.step < total and not self.budget_spent() and stop.received is None:
                metrics = self.train_step()  # adds its own seconds to wall_seconds
                t0 = time.perf_counter()
                if (cfg.eval.every and self.step % cfg.eval.every == 0) or self.step >= total or self.budget_spent():
                    metrics.update(self.evaluate())
                metrics.update(self._cumulative())
                metrics.update({"train/optimizer_steps": float(learner.optimizer_steps), "train/lr": learner.lr()})
                self.wall_seconds += time.perf_counter() - t0
                metrics.update({"time/total": self.wall_seconds, "sys/peak_rss_mb": note_peak(self.totals, metrics)})
                logger.log(self.step, metrics)
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save()
            if cfg.checkpoint_every or stop.received is not None:  # checkpoints only when asked (or to --resume)
                self.save()
        finally:
            logger.close()
            self._logger, self._files = None, {RUN_MARKER: logger.manifest()}

    def budget_spent(self, pending: int = 0) -> bool:
        """Whether the rollout budget is spent (counting ``pending`` rollouts not yet in the totals)."""
        b = self.config.rollout_budget
        return b is not None and self.totals["rollouts"] + pending >= b

    def _hands_on(self) -> bool:
        """Whether the next step may hand work on (``driver.carry_lag``): not before a checkpoint or the run's end
        (a checkpoint holds no carried work)."""
        cfg, nxt = self.config, self.step + 1
        return not ((cfg.checkpoint_every and nxt % cfg.checkpoint_every == 0) or nxt >= self._horizon)

    def release_carry(self) -> None:
        """Abort the rollouts the last step left running for the next one (before a checkpoint, at the run's end)."""
        from sara.driver import release_carry
        from sara.envs.base import StreamingEnv

        if self._carry is not None and isinstance(self.env, StreamingEnv):  # only a streaming step carries work
            release_carry(self.env, self._carry)
            self._carry = None

    def _step_budget(self) -> int | None:
        caps = [c for c in (self.config.max_rollouts_per_step,
                            None if self.config.rollout_budget is None
                            else self.config.rollout_budget - int(self.totals["rollouts"])) if c is not None]
        return max(1, min(caps)) if caps else None

    # ------------------------------------------------------------------------------------------------ metrics
    def _cumulative(self) -> dict[str, float]:
        t = self.totals
        return {"env/cum_rollouts": t["rollouts"], **cumulative_spend(t), "env/cum_effective_groups": t["effective_groups"], "env/cum_committed_groups": t["committed_groups"],
                "env/cum_verifier_errors": t["verifier_errors"], "env/cum_verifier_timeouts": t["verifier_timeouts"],
                "env/p_mixed_estimate": self.outcomes.p_mixed(), "train/step": float(self.step),
                "train/weights_version": float(self.version)}

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy with fixed seeds: ``eval/acc_sample`` (training temperature) and ``eval/acc_greedy``
        (``sara.train.evaluate``)."""
        from sara.train.evaluate import held_out_accuracy

        out = held_out_accuracy(self.config.eval, self.config.seed, self.eval_env, self.greedy_env, self.progress,
                                self.floor)
        self.floor.add(self.totals, "eval", out.get("eval/flop_floor", float("nan")))
        note_peak(self.totals, out)  # the run's peak counts its evaluations (step 0's too)
        if out:
            self.evals.append({"step": float(self.step), **out})
        return out

    def summary(self, records: Sequence[Mapping[str, Any]] | None = None) -> RunSummary:
        """Before/after accuracy (from the JSONL records when given, else from the evaluations run so far),
        rollouts, tokens, wall seconds and the DS estimate (``sara.train.summary.summarize``)."""
        return summarize_run(self, records)

    # --------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run bit for bit."""
        from sara.train.checkpoint import rng_state

        return {
            "config": self.config.model_dump(mode="json"),
            "counters": {"step": self.step, "version": self.version, "wall_seconds": self.wall_seconds},
            "totals": dict(self.totals),
            "outcomes": self.outcomes.state_dict(),
            "evals": list(self.evals),
            "learner": self.learner.state_dict(),
            "allocator": self.allocator.state_dict(),
            "sampler": self.sampler.state_dict(),
            "bank": self.bank.state_dict(),
            "rng": rng_state(),
            "files": {RUN_MARKER: self._logger.manifest()} if self._logger is not None else dict(self._files),
        }

    def save(self) -> Path | None:
        """Write ``<out_dir>/checkpoints/ckpt-<step>.pt`` (+ ``.sha256`` marker) atomically and prune old ones. A
        failed write (``OSError``: disk full) keeps the previous ones, warns saying so, returns None; training goes on."""
        from sara.train import checkpoint as ck
        from sara.train.rundir import checkpoint_failed

        self.release_carry()  # carried work is engine state, not checkpointed (a mid-carry save drops it)
        directory = self.out_dir / "checkpoints"
        path = ck.checkpoint_path(directory, self.step)
        if self._saved_step != self.step or not path.is_file():  # saved (or resumed from): pruned again only
            try:
                ck.save_checkpoint(self.state_dict(), path)
            except OSError as exc:
                print(f"sara: warning: {checkpoint_failed(path, exc)}", file=sys.stderr, flush=True)
                return None
            self._saved_step, self.last_checkpoint = self.step, path
        ck.prune_checkpoints(directory, self.config.keep_checkpoints, current=path)
        return path

    def load(self, path: str | Path) -> None:
        """Restore a checkpoint written by ``save`` (verified and validated, ``sara.train.resume``; no code runs)."""
        from sara.train.checkpoint import load_checkpoint

        self.load_state_dict(check_resume(self, Path(path), load_checkpoint(path)))
        self.resumed_from = self.last_checkpoint = Path(path)
        self._saved_step = self.step

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned and push the weights to the generator (unchecked: ``load`` checks)."""
        from sara.train.checkpoint import set_rng_state

        self.learner.load_state_dict(state["learner"])
        self.allocator.load_state_dict(state["allocator"])
        self.sampler.load_state_dict(state["sampler"])
        self.bank.load_state_dict(state.get("bank", {}), self.env.prompts)
        set_rng_state(state["rng"])
        c = state["counters"]
        self.step, self.version = int(c["step"]), int(c["version"])
        self.wall_seconds = float(c.get("wall_seconds", 0.0))
        self.totals = defaultdict(float, state["totals"])
        self.outcomes.load_state_dict(state["outcomes"])
        self.evals = list(state.get("evals", []))
        self._files = dict(state["files"])
        if self.version > 0:
            self.backend.update_weights(self.policy.state_dict(), self.version)

    def close(self) -> None:
        """Stop verifier workers and the backend."""
        self.release_carry()
        for env in (self.env, self.eval_env, self.greedy_env):
            if env is not None:
                env.close()
        self.scorer.close()
        self.backend.close()
        self._run_lock.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
