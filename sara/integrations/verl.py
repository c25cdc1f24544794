"""SARA inside verl's V1 trainer (verl 0.9.1, sync mode): a custom sampler that runs any sara allocator over verl's
rollouts.

Two config entries plug it in (``examples/verl/sara_grpo_gsm8k.yaml``; versions tested and limits: ``docs/verl.md``)::

    trainer.v1.sampler.custom_sampler.path: pkg://sara.integrations.verl
    trainer.v1.sampler.custom_sampler.name: SaraSampler
    actor_rollout_ref.rollout.agent.agent_loop_manager_class: sara.integrations.verl.SaraAgentLoopManager

with the options in ``trainer.v1.sampler.sampler_kwargs`` (``VerlSamplerConfig``: allocator and sampler specs, k,
seed, target groups, budgets). Every ``sample(partition_id="train")`` call is one ``sara.driver.collect`` step on a
``VerlRolloutEnv``: the allocator sizes each prompt's probes (``__rollout_n__`` of the rows the manager starts),
commits, abandons or continues on the scored rollouts (reward = ``rm_scores.sum()``, computed by verl's agent loop),
and fresh prompts come through verl's ``refill_fn`` (or a sara sampler over ``trainer.train_dataset``). The batch
returned is the committed groups' trajectory keys: variable-size groups, one ``uid`` per group (GRPO groups by it);
a committed group of one rollout is left out (verl's GRPO would give it its raw reward as advantage).
Every rollout started is accounted once: committed, abandoned or discarded when delivered, else cancelled on the
worker or dropped on landing (``sara/...`` metrics in verl's logger). Validation (``partition_id="val"``) is verl's
own ``ReplayBuffer.sample``.

verl, TransferQueue, tensordict and torch are imported on first use, so this module imports without them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import Field

from sara.allocators import BudgetAllocator, choose_allocator
from sara.build import build_allocation
from sara.config import ConfigError, SaraModel, validate_config
from sara.driver import DriverConfig, collect
from sara.integrations.verl_agent_loop import SaraAgentLoopManager, check_sampler_config
from sara.integrations.verl_env import VerlRolloutEnv
from sara.integrations.verl_sources import DatasetSource, VerlDataloaderSource
from sara.samplers import PromptSampler
from sara.types import CollectResult

__all__ = ["SaraAgentLoopManager", "SaraSampler", "VerlSamplerConfig", "check_trainer_config"]

POOL_SIZE = 2**31 - 1
"""Pool size the driver sees when verl's dataloader picks the prompts (pool index = the row's ``index``)."""


class VerlSamplerConfig(SaraModel):
    """``trainer.v1.sampler.sampler_kwargs`` of ``SaraSampler``."""

    allocator: str = "sara"
    """Allocator spec (``sara.allocators.make_allocator``): ``sara``, ``sara_paper:tau_low=0.45``, ``ds``, ``uniform``,
    ``module:Class``, ... (tree allocators are not supported)."""
    sampler: str = "verl"
    """Which prompts enter: ``verl`` = verl's dataloader order (``prepare_step``'s prompts, then ``refill_fn``); any
    sara sampler spec (``uniform``, ``predictive``, ...) = that sampler choosing from ``trainer.train_dataset``."""
    k: int | None = Field(None, ge=2)
    """Full group size (None = ``actor_rollout_ref.rollout.n``)."""
    seed: int = 0
    """Base seed: rollout j of a prompt gets the seed ``(seed, step, prompt, occurrence, j)``, passed to vLLM."""
    target_groups: int | None = Field(None, ge=1)
    """Committed groups per ``sample`` call (None = the batch size verl asks for, ``train_batch_size``)."""
    max_rollouts_per_step: int | None = Field(None, ge=1)
    """Rollouts one ``sample`` call may start (None = 4 x k x target groups)."""
    max_inflight_rollouts: int | None = Field(None, ge=1)
    """Rollouts in flight at most (None = k x target groups, what verl runs at once with a fixed group size)."""
    driver: Literal["stream", "rounds"] = "stream"
    """``stream``: rollouts start as slots free up and are decided on as they land (aborting what a closed prompt
    still runs); ``rounds``: synchronous rounds (a round is started whole and waited for)."""
    complete_groups: bool = False
    """Streaming: once the target is committed, wait for the committed groups still being filled to k."""
    fill_idle: bool = False
    """Streaming: admit a fresh prompt into every idle slot while groups are still needed."""
    poll_interval: float = Field(0.1, gt=0.0)
    """Seconds between TransferQueue reads while nothing lands (also verl's validation sampler)."""
    stall_timeout: float = Field(1800.0, gt=0.0)
    """Seconds without a rollout landing before the step fails."""
    max_retries: int = Field(2, ge=0)
    """Times a failed session (verl marks its prompt ``failure``) is started again, same seed, before the step fails."""


def check_trainer_config(config: Any) -> None:
    """Raise ``ConfigError`` for verl settings the sampler cannot run with (named in the message)."""
    mode = config.trainer.v1.trainer_mode
    if mode != "sync":
        raise ConfigError(f"SaraSampler: field 'trainer.v1.trainer_mode': {mode!r}; only 'sync' is supported (the "
                          "sampler drains every rollout before returning)")
    rm = config.reward.reward_model
    if rm.get("enable", False) and not rm.get("enable_resource_pool", False):
        raise ConfigError("SaraSampler: field 'reward.reward_model.enable': a colocated reward model scores rollouts "
                          "only after sampling; the allocator needs rewards as rollouts land (use a rule-based reward "
                          "or reward.reward_model.enable_resource_pool=True)")
    fg = config.algorithm.get("filter_groups", None)
    if fg is not None and fg.get("enable", False):
        raise ConfigError("SaraSampler: field 'algorithm.filter_groups.enable': sara decides which groups to keep; "
                          "drop DAPO's filter (allocator=ds is DAPO's dynamic sampling)")
    manager = str(config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class") or "")
    if not manager.endswith("SaraAgentLoopManager"):
        raise ConfigError("SaraSampler: field 'actor_rollout_ref.rollout.agent.agent_loop_manager_class': "
                          f"{manager!r}; set it to sara.integrations.verl.SaraAgentLoopManager (it holds the prompts "
                          "verl submits until the allocator starts them)")
    check_sampler_config(config)


def _plain(kwargs: Any) -> dict[str, Any]:
    """``sampler_kwargs`` as a plain dict (verl hands an OmegaConf ``DictConfig``, or None)."""
    if kwargs is None:
        return {}
    if type(kwargs).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return dict(OmegaConf.to_container(kwargs, resolve=True))  # type: ignore[arg-type]
    return dict(kwargs)


class SaraSampler:
    """verl's custom sampler (``trainer.v1.sampler.custom_sampler``) driving a sara allocator (see the module).

    verl builds it with exactly these arguments (``PPOTrainer._build_replay_buffer``). The trainer is reached through
    ``refill_fn`` (a bound method of it): its config, ``agent_loop_manager`` (set by ``fit``), dataset and step.

    Attributes:
        allocator: The sara allocator (state carried across steps: priors, counters).
        last_result: The last training step's ``CollectResult`` (groups, accounting).
        last_env: The last training step's ``VerlRolloutEnv`` (verl-side counts).
        idle: Called between TransferQueue reads instead of sleeping (tests); None = sleep ``poll_interval``.
    """

    def __init__(self, trainer_mode: str, trainer_config: Any, max_off_policy_threshold: int | None,
                 max_off_policy_strategy: str, sampler_kwargs: Any = None, refill_fn: Callable[[int], int] | None = None,
                 **_verl_defaults: Any) -> None:
        from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

        self.config = validate_config(VerlSamplerConfig, _plain(sampler_kwargs),
                                      what="trainer.v1.sampler.sampler_kwargs")
        self.trainer = getattr(refill_fn, "__self__", None)
        if self.trainer is None or not hasattr(self.trainer, "config"):
            raise ConfigError("SaraSampler: field 'refill_fn': expected the trainer's bound _add_prompts_to_generate "
                              "(verl's PPOTrainer passes it)")
        check_trainer_config(self.trainer.config)
        self.refill_fn = refill_fn
        self.k = int(self.config.k or self.trainer.config.actor_rollout_ref.rollout.n)
        self.choice = choose_allocator(self.config.allocator, k=self.k)
        cls, options = self.choice.cls, self.choice.config
        if cls.name == "sara_tree":
            raise ConfigError("SaraSampler: field 'allocator': tree allocators grow partial traces, which verl's agent "
                              "loop cannot continue; use a prompt-level allocator")
        # Built here with verl's dataloader as the source; with a sara sampler, built with it once the dataset exists
        # (the allocator may read the sampler's history). Building checks the options now: an allocator that needs
        # the pool's prompts (group_by) fails here, not mid-run.
        alone = cls(options)
        self._allocator: BudgetAllocator | None = alone if self.config.sampler == "verl" else None
        self.prompt_sampler: PromptSampler | None = None
        self.validation = ReplayBuffer(trainer_mode=trainer_mode, trainer_config=trainer_config,
                                       max_off_policy_threshold=max_off_policy_threshold,
                                       max_off_policy_strategy=max_off_policy_strategy, sampler_kwargs=sampler_kwargs,
                                       poll_interval=self.config.poll_interval, refill_fn=refill_fn)
        sync_step = (trainer_config or {}).get("parameter_sync_step", 1) if trainer_config is not None else 1
        self.parameter_sync_step = int(sync_step or 1)
        self.last_result: CollectResult | None = None
        self.last_env: VerlRolloutEnv | None = None
        self.idle: Callable[[], None] | None = None
        self._calls: tuple[int, int] = (-1, 0)  # (global step, sample calls in it)

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[Any, dict[str, float]]:
        """One batch: ``(KVBatchMeta of the committed trajectory keys, sara/... metrics)``.

        Raises:
            ConfigError: the agent-loop manager is not ``SaraAgentLoopManager``.
            RuntimeError: no group was committed within the step's budget, or rollouts stopped landing.
        """
        if partition_id != "train":
            return self.validation.sample(global_steps=global_steps, partition_id=partition_id, batch_size=batch_size)
        manager = getattr(self.trainer, "agent_loop_manager", None)
        if not isinstance(manager, SaraAgentLoopManager):
            raise ConfigError(f"SaraSampler: the trainer's agent_loop_manager is {type(manager).__name__}; set "
                              "actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                              "sara.integrations.verl.SaraAgentLoopManager")
        cfg = self.config
        target = int(cfg.target_groups or batch_size)
        slots = int(cfg.max_inflight_rollouts or self.k * target)
        env = VerlRolloutEnv(manager, global_steps=global_steps, slots=slots, pool_size=POOL_SIZE,
                             poll_interval=cfg.poll_interval, stall_timeout=cfg.stall_timeout,
                             max_retries=cfg.max_retries, idle=self.idle)
        self.last_env = env
        source = self._source(env, manager)
        driver = (DriverConfig(barrier=True) if cfg.driver == "rounds"
                  else DriverConfig(barrier=False, slots=slots, complete_groups=cfg.complete_groups,
                                    fill_idle=cfg.fill_idle))
        result = collect(self.allocator, env, source, target_groups=target, driver=driver,
                         max_rollouts=int(cfg.max_rollouts_per_step or 4 * self.k * target), seed=cfg.seed,
                         step=self._step(global_steps), policy_version=global_steps)
        env.drain()
        if isinstance(source, VerlDataloaderSource):
            env.release(source.leftover())
        env.release([uid for uid, _ in manager.take_held()])
        # verl's GRPO gives a group of one its raw reward as advantage (mean 0, std 1); sara's gives it 0: leave it out
        groups = [g for g in result.groups if g.size >= 2]
        env.counts["singletons_left_out"] += len(result.groups) - len(groups)
        batch = env.finish([g.rollouts for g in groups])
        self.last_result = result
        _check_accounting(result, env, len(batch.keys))
        if not groups:
            raise RuntimeError(f"SaraSampler: step {global_steps} committed no group of two or more rollouts "
                               f"({result.stats.stop_reason} after {result.stats.rollouts} rollouts); raise "
                               "sampler_kwargs.max_rollouts_per_step")
        return batch, self._metrics(result, env, len(batch.keys))

    def _step(self, global_steps: int) -> int:
        """sara's step index of this call: ``parameter_sync_step`` calls per verl step, numbered from 0."""
        step, n = self._calls
        n = n + 1 if step == global_steps else 0
        self._calls = (global_steps, n)
        return (int(global_steps) - 1) * self.parameter_sync_step + n

    def _source(self, env: VerlRolloutEnv, manager: SaraAgentLoopManager) -> Any:
        data = self.trainer.config.data
        if self.config.sampler == "verl":
            gen = int(data.get("gen_batch_size", None) or data.train_batch_size)
            return VerlDataloaderSource(env, manager, self.refill_fn, gen_batch_size=gen,  # type: ignore[arg-type]
                                        pool_size=POOL_SIZE)
        sampler = self._prompt_sampler()
        env.release([uid for uid, _ in manager.take_held()])  # prepare_step's prompts: the sara sampler picks instead
        return DatasetSource(sampler, env, manager, self.trainer)

    @property
    def allocator(self) -> BudgetAllocator:
        """The sara allocator (state carried across steps: priors, counters)."""
        if self._allocator is None:
            self._prompt_sampler()
        assert self._allocator is not None
        return self._allocator

    def _prompt_sampler(self) -> PromptSampler:
        """The sara prompt sampler over verl's training dataset, built with the allocator the first time it is needed
        (the dataset exists once verl's trainer is set up)."""
        if self.prompt_sampler is None:
            built = build_allocation(self.choice, self.config.sampler, k=self.k,
                                     pool_size=len(self.trainer.train_dataset), seed=self.config.seed)
            self._allocator, self.prompt_sampler = built.allocator, built.sampler
        return self.prompt_sampler

    def _metrics(self, result: CollectResult, env: VerlRolloutEnv, batch_rollouts: int) -> dict[str, float]:
        out = result.stats.as_metrics(prefix="sara/")
        out.update({f"sara/{k}": float(v) for k, v in self.allocator.metrics().items()})
        out.update({f"sara/verl/{k}": float(v) for k, v in sorted(env.counts.items())})
        sizes = [g.size for g in result.groups if g.size >= 2]
        out.update({"sara/group_size/mean": sum(sizes) / len(sizes), "sara/group_size/min": float(min(sizes)),
                    "sara/group_size/max": float(max(sizes)), "sara/batch_rollouts": float(batch_rollouts),
                    f"sara/stop/{result.stats.stop_reason}": 1.0})
        return out

    def state_dict(self) -> dict[str, Any]:
        """The allocator's and the sara sampler's cross-step state (verl does not checkpoint a custom sampler)."""
        return {"allocator": self.allocator.state_dict(),
                "sampler": None if self.prompt_sampler is None else self.prompt_sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.allocator.load_state_dict(state["allocator"])
        if state.get("sampler") is not None:
            self._prompt_sampler().load_state_dict(state["sampler"])


def _check_accounting(result: CollectResult, env: VerlRolloutEnv, batch_keys: int) -> None:
    """Every rollout started ends delivered (in a committed, abandoned or discarded group) or aborted (cancelled on a
    worker, or dropped when it landed), and the batch holds exactly the committed rollouts' keys."""
    states = Counter(f.state for f in env.flights.values())
    s = result.stats
    if states["live"] or states["dropping"]:
        raise AssertionError(f"SaraSampler: rollouts still in flight after the step: {dict(states)}")
    if states["delivered"] != s.rollouts or states["cancelled"] + states["dropped"] != s.aborted_rollouts:
        raise AssertionError(f"SaraSampler: accounting broken: verl side {dict(states)}, driver {s.rollouts} delivered "
                             f"+ {s.aborted_rollouts} aborted")
    singles = env.counts["singletons_left_out"]
    if batch_keys < s.committed_rollouts - singles:
        raise AssertionError(f"SaraSampler: batch has {batch_keys} keys for {s.committed_rollouts} committed rollouts "
                             f"({singles} in singleton groups left out)")
