"""SARA inside TRL's ``AsyncGRPOTrainer``: a rollout worker that allocates with any ``sara`` allocator.

TRL 1.16's ``trl.experimental.async_grpo.AsyncGRPOTrainer(model, ..., rollout_worker=..., weight_transfer=...)``
trains on a queue of ``RolloutSample`` s, each carrying its own ``group_id`` and scalar ``advantage``; it never
reshapes by group size, so the variable-size groups SARA commits fit as they are. ``SaraRolloutWorker`` implements
TRL's ``RolloutWorkerProtocol``:

- a background thread runs the driver (``sara.driver.collect``: allocator + prompt sampler + ``RolloutEnv``, e.g. a
  ``TaskEnv`` on an HF or tiny backend) step after step, in synchronous rounds or, with ``driver={"barrier": False,
  ...}`` on a streaming backend, rollout by rollout (continuous batching; ``carry_lag`` hands open prompts and their
  running rollouts to the next step); every committed group gets advantages from ``sara.algos.ADVANTAGES`` by group id
  (GRPO by default: exactly 0 for singletons and saturated groups) and its rollouts go to ``rollout_buffer``;
- per step it puts SARA's accounting on ``metrics_queue`` (``sara/...`` keys), which the trainer merges into its logs;
- ``update_model_version`` is checked like the Ray pool's weight versions: the worker's backend must hold exactly the
  version the trainer announces, and every sample is tagged with the oldest weights version that generated any part
  of its group (a rollout's ``policy_version``: carried rollouts are older), so TRL's ``max_staleness`` drop is
  conservative.

``worker.weight_transfer()`` is the matching ``WeightTransferProtocol`` (``sara.integrations.trl_sync``): ``pause``
takes the worker's weights gate, ``send_weights`` loads the trainer's parameters into the backend
(``backend.update_weights(state, version)``) and ``resume`` lets generation go on. On a backend that generates in
decode steps (``SteppedEngine``: the HF backend) a sync cuts in at the next decode step of the round or streaming
poll in flight; the rows in flight keep their tokens and go on with the new weights, as TRL's vLLM path does
(``pause(mode="keep")``). TRL's own vLLM-server path (NCCL weight transfer to ``trl vllm-serve``) is not used: it needs
CUDA, and this integration is tested on CPU.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from sara.algos import ADVANTAGES, AdvantageInputs
from sara.allocators import BudgetAllocator, make_allocator
from sara.config import ConfigError, validate_config
from sara.driver import DriverConfig, collect, release_carry
from sara.envs.base import EnvWrapper, SteppedEngine, StreamingEnv, Versioned
from sara.integrations.trl_sync import BackendWeightTransfer, WeightsGate
from sara.metrics import OutcomeCounts, ds_estimate_applies
from sara.samplers import make_sampler
from sara.types import CollectResult, Group, Rollout, RolloutRequest

__all__ = ["SaraRolloutWorker", "BackendWeightTransfer", "WeightsVersionError", "rollout_samples"]


class WeightsVersionError(RuntimeError):
    """The trainer announced a weights version the worker's backend does not hold."""


class _Stopped(Exception):
    """Raised inside a round when the worker is stopping (ends the collect step early)."""


def _messages(x: Any, role: str) -> list[dict[str, str]]:
    return [dict(m) for m in x] if not isinstance(x, str) else [{"role": role, "content": x}]


def rollout_samples(groups: Sequence[Group], advantages: np.ndarray, group_ids: Sequence[int], *,
                    model_versions: Sequence[int]) -> list[Any]:
    """TRL ``RolloutSample`` s for committed groups (one per rollout with generated tokens); ``model_versions[i]`` is
    the oldest weights version that generated any rollout of ``groups[i]``.

    ``input_ids`` = prompt tokens + completion tokens; ``completion_mask`` and ``old_log_probs`` are aligned with it
    (0 over the prompt, the generator's log-probs over the completion). ``advantages`` is flat over the groups'
    rollouts in order; ``group_ids[i]`` is the trainer-wide id of ``groups[i]``.
    """
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    out: list[Any] = []
    j = 0
    for group, gid, version in zip(groups, group_ids, model_versions, strict=True):
        rewards = group.rewards
        for r in group.rollouts:
            adv = float(advantages[j])
            j += 1
            out.extend(_sample(RolloutSample, group, r, adv, int(gid), int(version), float(rewards.std())))
    return out


def _sample(cls: Any, group: Group, r: Rollout, adv: float, gid: int, version: int, reward_std: float) -> list[Any]:
    if r.prompt_token_ids is None or r.token_ids is None or r.logprobs is None:
        raise ValueError("SaraRolloutWorker: the backend must return prompt_token_ids, token_ids and logprobs")
    if not r.token_ids:
        return []  # nothing to train on
    prompt, completion = list(r.prompt_token_ids), list(r.token_ids)
    return [cls(prompt=_messages(group.prompt.prompt, "user"), completion=_messages(r.completion, "assistant"),
                input_ids=np.asarray(prompt + completion, dtype=np.int64),
                completion_mask=np.asarray([0] * len(prompt) + [1] * len(completion), dtype=np.int64),
                old_log_probs=np.asarray([0.0] * len(prompt) + list(r.logprobs), dtype=np.float32),
                advantage=adv, model_version=version, group_id=gid,
                metrics={"reward": float(r.reward), "reward_std": reward_std})]


class _VersionedEnv(EnvWrapper):
    """The worker's view of its env: every engine call (a round, a streaming submit / poll) under the weights gate,
    after checking the backend holds the announced version."""

    def __init__(self, worker: SaraRolloutWorker) -> None:
        super().__init__(worker.env)
        self.worker = worker

    def _locked(self, call: Any, *args: Any) -> Any:
        w = self.worker
        with w.gate.generating():
            if w._stop.is_set():
                raise _Stopped
            version = w.backend_version
            if version < w.model_version:
                raise WeightsVersionError(f"SaraRolloutWorker: the trainer announced weights version {w.model_version} "
                                          f"but the backend holds version {version}")
            out = call(*args)
        w._heartbeat = time.monotonic()
        return out

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        return self._locked(self.env.rollout, requests)

    def submit(self, items: Sequence[tuple[int, RolloutRequest]]) -> None:
        self._locked(self.env.submit, items)

    def poll(self, timeout: float | None = None) -> list[tuple[int, Rollout]]:
        return self._locked(self.env.poll, timeout)


class SaraRolloutWorker:
    """TRL ``RolloutWorkerProtocol`` running a ``sara`` allocator (see the module docstring).

    Args:
        env: A ``RolloutEnv`` whose ``backend`` generates (``TaskEnv(task, backend)``); with TRL's trainer the backend
            must tokenize like the trained model (same tokenizer) and return token ids and log-probs.
        allocator: An allocator spec (``"sara_paper:completion=as_is"``, ``"sara"``, ``"ds"``, ``"uniform"``,
            ``"sara:prior=history,decay=0.95"``, ...) or instance.
        k: Group size of the allocator.
        sampler: Prompt sampler spec (``"uniform"``, ``"predictive:decay=0.95"``, ...) or instance.
        target_groups: Committed groups per ``collect`` step (one step = one push of samples and metrics).
        driver: ``sara.driver.DriverConfig`` (or a mapping of its fields): synchronous rounds (default) or streaming
            (``{"barrier": False, "carry_lag": 1, ...}``, on a streaming backend).
        advantage: An outcome-level estimator spec of ``sara.algos.ADVANTAGES`` (``grpo``, ``dr_grpo``, ``rloo``,
            ``grpo:eps=1e-4``): TRL's samples carry one scalar advantage each.
        seed: Base seed of the rollouts and the sampler.
        max_rollouts: Optional rollout budget per step.
        queue_maxsize: Bound of ``rollout_buffer`` (the worker waits when the trainer lags).

    Raises:
        ConfigError: an invalid allocator / sampler / advantage spec, or a token-level advantage estimator.
    """

    def __init__(self, env: Any, allocator: str | BudgetAllocator = "sara_paper:completion=as_is", *,
                 k: int = 8, sampler: Any = "uniform", target_groups: int = 8, advantage: str = "grpo",
                 seed: int = 0, max_rollouts: int | None = None, queue_maxsize: int = 1024,
                 driver: DriverConfig | Mapping[str, Any] | None = None) -> None:
        self.env = env
        self.driver = driver if isinstance(driver, DriverConfig) else validate_config(
            DriverConfig, dict(driver or {}), what="SaraRolloutWorker: driver")
        if not self.driver.barrier and not isinstance(env, StreamingEnv):
            raise ConfigError(f"SaraRolloutWorker: field 'driver': streaming needs a streaming environment and "
                              f"{type(env).__name__} cannot stream; use driver=None (synchronous rounds)")
        self.allocator = make_allocator(allocator, k=k)
        self.k = int(self.allocator.k)
        self.sampler = make_sampler(sampler, len(env.prompts), seed=seed, k=self.k)
        fn, options = ADVANTAGES.from_spec(advantage)
        name = advantage.split(":", 1)[0]
        if not ADVANTAGES.is_outcome_level(name):
            raise ConfigError(f"SaraRolloutWorker: field 'advantage': {name!r} is token-level; TRL's rollout samples "
                              f"carry one scalar advantage each (use one of "
                              f"{sorted(ADVANTAGES.outcome_level_names())})")
        self._adv_fn = fn
        self._adv_params = validate_config(ADVANTAGES.params_model(name), options,
                                           what=f"advantage {name!r}").model_dump()
        self.target_groups, self.seed, self.max_rollouts = int(target_groups), int(seed), max_rollouts
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0
        self.outcomes = OutcomeCounts(self.k)
        self.totals = {"rollouts": 0, "tokens": 0, "effective_groups": 0, "committed_groups": 0}
        self.pushed_groups: dict[int, int] = {}  # trainer-wide group id -> group size
        self.steps = 0
        self._next_gid = 0
        self._stop = threading.Event()
        self.gate = WeightsGate(self._stop.is_set, _Stopped)  # weight syncs and evaluations cut in through it
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._heartbeat = time.monotonic()
        self._carry: Any = None  # streaming with carry-over: what the last step handed on

    # -------------------------------------------------------------------------------------------- weights
    @property
    def backend(self) -> Any:
        return self.env.backend

    @property
    def backend_version(self) -> int:
        return int(self.backend.version) if isinstance(self.backend, Versioned) else 0

    def weight_transfer(self) -> BackendWeightTransfer:
        """The ``WeightTransferProtocol`` that loads the trainer's weights into this worker's backend."""
        return BackendWeightTransfer(self)

    def update_model_version(self, model_version: int) -> None:
        """The trainer's live weights version. Once started, the backend must hold exactly that version.

        Raises:
            WeightsVersionError: the worker is running and its backend holds another version (the trainer synced
                weights elsewhere, e.g. through another ``weight_transfer``).
        """
        v = int(model_version)
        if self._thread is not None and self.backend_version != v:
            raise WeightsVersionError(f"SaraRolloutWorker: the trainer announced weights version {v} but the backend "
                                      f"holds version {self.backend_version}; pass weight_transfer="
                                      "worker.weight_transfer() to the trainer")
        self.model_version = v

    # -------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start producing rollouts (a daemon thread)."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._heartbeat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="sara-rollout-worker", daemon=True)
        self.gate.generator = self._thread
        if isinstance(self.backend, SteppedEngine):
            self.backend.between_steps = self.gate.between_steps  # a sync cuts in between decode steps
        self._thread.start()

    def stop(self) -> None:
        """Stop after the round (or poll) in flight; rollouts carried for the next step are aborted. The worker can be
        started again."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=600)
        self._thread = self.gate.generator = None
        if isinstance(self.backend, SteppedEngine) and self.backend.between_steps == self.gate.between_steps:
            self.backend.between_steps = None
        if self._carry is not None:
            release_carry(self.env, self._carry)
            self._carry = None

    def __enter__(self) -> SaraRolloutWorker:
        """``with SaraRolloutWorker(...) as worker:`` stops the worker on leaving the block, however it is left (TRL's
        trainer starts it when training begins, after its first weight sync)."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the worker thread failed, or produced nothing for ``stale_after_s`` seconds."""
        if self._error is not None:
            raise RuntimeError("SaraRolloutWorker failed; see the chained exception") from self._error
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("SaraRolloutWorker is not running")
        age = time.monotonic() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(f"SaraRolloutWorker heartbeat stale: {age:.0f}s > {stale_after_s:.0f}s")

    def _run(self) -> None:
        env = _VersionedEnv(self)
        try:
            while not self._stop.is_set():
                result = collect(self.allocator, env, self.sampler, target_groups=self.target_groups,
                                 max_rollouts=self.max_rollouts, seed=self.seed, driver=self.driver, carry=self._carry,
                                 policy_version=self.backend_version)
                self._carry = result.carry
                self._publish(result)
        except _Stopped:
            self._carry = None  # the interrupted step aborted what it had running, the carry's rollouts included
        except BaseException as exc:  # reported through check_health, raised in the trainer
            self._carry, self._error = None, exc

    def evaluate(self, eval_env: Any, *, num_prompts: int = 100, samples: int = 2, seed: int = 0) -> dict[str, float]:
        """Held-out accuracy of the backend's current weights (``sara.train.evaluate.held_out_accuracy``: fixed seeds,
        so two calls compare), taken through the weights gate like a sync (at the worker's next decode step on a
        ``SteppedEngine``): the worker waits meanwhile.

        Args:
            eval_env: A ``RolloutEnv`` over held-out prompts on this worker's backend
                (``TaskEnv(task, worker.backend, split="eval")``).
            num_prompts: The first this many held-out prompts.
            samples: Sampled completions per prompt.
            seed: Base seed of the evaluation's rollouts.

        Returns:
            ``eval/acc_sample``, the solved / unsolved / mixed fractions, ``time/eval`` and ``eval/weights_version``.
        """
        from sara.train.evaluate import held_out_accuracy
        from sara.train.sections import EvalConfig

        settings = EvalConfig(num_prompts=num_prompts, samples=samples, greedy=False, by=None)
        self.gate.hold()
        try:
            out = held_out_accuracy(settings, seed, eval_env)
            out["eval/weights_version"] = float(self.backend_version)
        finally:
            self.gate.release()
        return out

    # -------------------------------------------------------------------------------------------- output
    def advantages(self, groups: Sequence[Group]) -> np.ndarray:
        """Flat advantages over the groups' rollouts from the configured ``sara.algos`` estimator (by group id)."""
        if not groups:
            return np.zeros(0)
        rewards = torch.tensor(np.concatenate([g.rewards for g in groups]), dtype=torch.float64)
        gids = torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts])
        adv, _ = self._adv_fn(AdvantageInputs(rewards=rewards, group_ids=gids,
                                              response_mask=torch.ones(len(rewards), 1)), **self._adv_params)
        return adv[:, 0].numpy()

    def _publish(self, result: CollectResult) -> None:
        groups = list(result.groups)
        gids = list(range(self._next_gid, self._next_gid + len(groups)))
        self._next_gid += len(groups)
        versions = [min((r.policy_version for r in g.rollouts if r.policy_version is not None),
                        default=self.backend_version) for g in groups]
        samples = rollout_samples(groups, self.advantages(groups), gids, model_versions=versions)
        self.metrics_queue.put(self.step_metrics(result, min(versions, default=self.backend_version)))
        for gid, g in zip(gids, groups):
            self.pushed_groups[gid] = g.size
        for s in samples:
            while True:
                if self._stop.is_set():
                    return
                try:
                    s.enqueued_at = time.time()
                    self.rollout_buffer.put(s, timeout=0.5)
                    break
                except queue.Full:
                    continue
        self.steps += 1
        self._heartbeat = time.monotonic()

    def step_metrics(self, result: CollectResult, version: int) -> dict[str, float | tuple[float, float]]:
        """``sara/...`` metrics of one step in TRL's metric-sink shapes (``*_total`` summed over a logging window,
        ``*_min`` / ``*_max`` extrema, ``(num, den)`` pairs rates, the rest window means)."""
        st = result.stats
        self.outcomes.record([*result.groups, *result.abandoned, *result.discarded])
        for key in self.totals:
            self.totals[key] += st.__dict__[key]
        sizes = [g.size for g in result.groups] or [0]
        p_mixed = self.outcomes.p_mixed()
        ds = self.totals["effective_groups"] * self.k / p_mixed if p_mixed > 0 else float("nan")
        return {
            "sara/rollouts_total": float(st.rollouts), "sara/tokens_total": float(st.tokens),
            "sara/committed_groups_total": float(st.committed_groups),
            "sara/effective_groups_total": float(st.effective_groups),
            "sara/abandoned_groups_total": float(st.abandoned_groups),
            "sara/abandoned_rollouts_total": float(st.abandoned_rollouts),
            "sara/discarded_rollouts_total": float(st.discarded_rollouts),
            "sara/effective_fraction": (float(st.effective_groups), float(st.committed_groups)),
            "sara/rounds_per_step": float(st.rounds),
            "sara/group_size_mean": float(np.mean(sizes)), "sara/group_size_min": float(min(sizes)),
            "sara/group_size_max": float(max(sizes)),
            "sara/p_mixed_estimate": p_mixed, "sara/cum_rollouts": float(self.totals["rollouts"]),
            "sara/weights_version": float(version),
            **({"sara/ds_rollouts_estimate": ds, "sara/rollouts_saved_vs_ds": ds - self.totals["rollouts"]}
               if ds_estimate_applies(self.sampler) else {}),  # a selective sampler's draws undercount DS
        }
