"""Core value types shared by allocators, environments, algorithms and the trainer.

Everything here is a frozen dataclass: a rollout, once generated and scored, never changes; a group is a tuple of
rollouts plus the decision that closed it. Groups are keyed by id and may have any size >= 1 (never reshape a batch
into ``[num_prompts, k]``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Decision",
    "Prompt",
    "RolloutRequest",
    "Rollout",
    "Group",
    "CollectStats",
    "CollectResult",
]


class Decision(enum.IntEnum):
    """What an allocator says about an allocation unit after an observation.

    The integer values are used in vectorized decision arrays (``np.int8``).
    """

    CONTINUE = 0
    """Keep probing: the unit gets more rollouts in a later round."""
    COMMIT = 1
    """The group goes to the training batch (after being completed to k rollouts in ``complete`` mode)."""
    ABANDON = 2
    """Stop spending on this unit; its remaining budget is freed. Its rollouts are accounted as abandoned."""
    DISCARD = 3
    """The unit was fully generated but is not used (e.g. DS drops a saturated group, or the step ended)."""


@dataclass(frozen=True)
class Prompt:
    """One item of a prompt pool.

    Attributes:
        id: Stable human-readable id (e.g. ``"countdown-000123"``).
        prompt: Prompt text, or chat messages (``[{"role": ..., "content": ...}, ...]``).
        answer: Answer fields handed to the verifier as keyword arguments (e.g. ``{"numbers": [..], "target": 24}``).
        metadata: Free-form extras (difficulty, source, ...). Never read by the allocator.
    """

    id: str
    prompt: str | Sequence[Mapping[str, str]] = ""
    answer: Mapping[str, Any] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutRequest:
    """Ask an environment for ``len(seeds)`` rollouts of one prompt (one entry of one batched round).

    Attributes:
        unit_id: The allocation unit (a prompt, or a node of a rollout tree) the rollouts are for.
        pool_index: Index of the prompt in the environment's pool (``env.prompts[pool_index]``).
        prompt: The prompt itself (``env.prompts[pool_index]``), so remote workers need no pool.
        seeds: One seed per rollout. Rollout ``j`` of a unit always gets the same seed whatever round it is generated
            in, so results do not depend on how rounds are batched or sharded across workers.
        prefix: Text appended to the rendered prompt before generation (a partial trace, for tree rollouts).
        max_new_tokens: Optional per-request cap on generated tokens (``None`` = the backend's setting).
        index: The index j within its unit of the request's first rollout (rollout ``i`` of the request is rollout
            ``index + i`` of the unit, seeded accordingly).
    """

    unit_id: int
    pool_index: int
    prompt: Prompt
    seeds: tuple[int, ...]
    prefix: str = ""
    max_new_tokens: int | None = None
    index: int = 0

    @property
    def n(self) -> int:
        """Number of rollouts requested."""
        return len(self.seeds)


@dataclass(frozen=True)
class Rollout:
    """One sampled completion with its verified reward.

    Attributes:
        prompt_id: ``Prompt.id`` of the prompt it answers.
        pool_index: Index of the prompt in the pool.
        completion: Generated text (empty for simulated rollouts).
        reward: Verifier score (0/1 for binary tasks; any float for continuous ones).
        num_tokens: Number of generated tokens.
        seed: The seed it was generated with.
        token_ids: Generated token ids, when the backend returns them (needed for training).
        logprobs: Per-token log-probabilities under the generating policy, aligned with ``token_ids``.
        prompt_token_ids: Token ids of the rendered prompt (+ prefix), when known.
        finish_reason: ``"stop"``, ``"length"``, ... as reported by the backend.
        policy_version: Weights version of the generator when the rollout started (None = unknown). A rollout older
            than the learner's weights is trained with its generator's log-probs as old log-probs.
        metadata: Free-form extras (verifier diagnostics, tree node ids, ...).
    """

    prompt_id: str
    pool_index: int
    completion: str
    reward: float
    num_tokens: int
    seed: int = 0
    token_ids: tuple[int, ...] | None = None
    logprobs: tuple[float, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None
    policy_version: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the engine read for this rollout (0 when the backend reports no prompt token ids)."""
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else 0


@dataclass(frozen=True)
class Group:
    """The rollouts of one allocation unit, closed by a decision.

    Attributes:
        group_id: Unique id within a collection step (the allocation unit id).
        prompt: The prompt.
        pool_index: Index of the prompt in the pool.
        rollouts: The rollouts, in generation order. Any size >= 1.
        decision: ``COMMIT`` (training batch), ``ABANDON`` or ``DISCARD``.
        metadata: Extras from the allocator (e.g. the tree node, p_eff at the decision).
    """

    group_id: int
    prompt: Prompt
    pool_index: int
    rollouts: tuple[Rollout, ...]
    decision: Decision
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Number of rollouts in the group."""
        return len(self.rollouts)

    @property
    def rewards(self) -> np.ndarray:
        """Rewards as a float64 array of shape ``[size]``."""
        return np.fromiter((r.reward for r in self.rollouts), dtype=np.float64, count=len(self.rollouts))

    @property
    def num_tokens(self) -> int:
        """Total generated tokens in the group."""
        return sum(r.num_tokens for r in self.rollouts)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens the engine read for the group's rollouts: each rollout's ``prompt_token_ids`` (0 for a
        rollout whose backend reports none)."""
        return sum(r.prompt_tokens for r in self.rollouts)

    def is_effective(self, eps: float = 1e-6) -> bool:
        """True when the group carries a gradient signal: size >= 2 and reward std > ``eps``.

        Uses a tolerance, never ``std == 0`` (float rewards that differ by rounding noise are not a signal).
        """
        return self.size >= 2 and float(np.std(self.rewards)) > eps


@dataclass(frozen=True)
class CollectStats:
    """Exact accounting of one collection step (``sara.driver.collect``).

    Invariants (checked by ``sara.testing.check_allocator``)::

        rollouts == committed_rollouts + abandoned_rollouts + discarded_rollouts   (+ carried_out - carried_in)
        tokens   == committed_tokens   + abandoned_tokens   + discarded_tokens     (when nothing is carried)
        tokens started == tokens + aborted_tokens (streaming: an aborted rollout's tokens are in no group)
        rollouts <= max_rollouts (when a budget was given)

    Attributes:
        rollouts: Rollouts generated in this step.
        tokens: Tokens generated in this step.
        rounds: Environment calls that delivered rollouts (rounds; polls when streaming).
        committed_groups: Groups handed to the training batch.
        effective_groups: Committed groups that are effective (reward std > eps).
        abandoned_groups: Units abandoned by the allocator.
        discarded_groups: Units fully or partly generated but unused (saturated under DS, or in flight at the stop).
        committed_rollouts: Rollouts in committed groups.
        abandoned_rollouts: Rollouts in abandoned units.
        discarded_rollouts: Rollouts in discarded units.
        committed_tokens: Tokens in committed groups.
        abandoned_tokens: Tokens in abandoned units.
        discarded_tokens: Tokens in discarded units.
        prompt_tokens: Prompt (prefill) tokens of the rollouts generated in this step, counted once per rollout as the
            engine received it (an engine that caches a shared prefix computes fewer); 0 for rollouts whose backend
            reports no prompt token ids (the simulator).
        prompts_drawn: Fresh prompts admitted from the sampler.
        stop_reason: Why the loop stopped: ``target_reached``, ``max_rollouts``, ``max_step_rollouts`` (the driver's
            bound against steps where nothing is effective), ``max_rounds``, ``pool_exhausted``, ``allocator_done``
            (e.g. DS hit ``max_gen_batches``).
        target_groups: The requested number of effective/committed groups.
        allocator_seconds: Wall time spent inside the allocator's calls (step start and end, dispatch, admission,
            delivered results, aborts, carry-over).
        env_seconds: Wall time spent inside the environment.
        decisions: Per-unit decisions the allocator made in the step (its ``alloc/decisions`` counter: sequential
            rules decide each probing unit a delivery reaches, full-group allocators each complete group).
        wrong_abandons: Abandoned units whose full size-k group would have been mixed (only when the environment can
            tell, e.g. the simulator; else ``None``).
        effective_rollouts: Rollouts inside effective committed groups.
        aborted_rollouts: Rollouts started and cancelled before they finished (streaming: in-flight rollouts of
            units closed without them, and everything in flight at the step's end). They are in no group and not in
            ``rollouts``: rollouts started == ``rollouts + aborted_rollouts``. 0 in synchronous rounds.
        aborted_tokens: Tokens the aborted rollouts had generated when cancelled (as the engine reported them; not
            in ``tokens``). 0 in synchronous rounds.
        mean_inflight: Streaming: rollouts in flight averaged over the driver's ``poll`` calls (poll-weighted, not
            time-weighted: each poll counts once, with the rollouts in flight when it was issued), a measure of
            engine occupancy next to ``env.slots``. 0 in synchronous rounds.
        carried_in_rollouts: Streaming carry-over (``DriverConfig.carry_lag``): rollouts delivered in earlier steps
            to units re-admitted in this one (in this step's groups, not in ``rollouts``).
        carried_out_rollouts: Rollouts delivered so far to the units handed on to the next step (in ``rollouts``, in
            no group of this step).
        carried_in_inflight: Rollouts still running on the engine when this step received them (they finish here:
            in ``rollouts`` or ``aborted_rollouts``, though not started here).
        carried_out_inflight: Rollouts left running on the engine for the next step (started, neither delivered nor
            aborted here): rollouts started + ``carried_in_inflight`` == ``rollouts + aborted_rollouts +
            carried_out_inflight``.
    """

    rollouts: int = 0
    tokens: int = 0
    rounds: int = 0
    committed_groups: int = 0
    effective_groups: int = 0
    abandoned_groups: int = 0
    discarded_groups: int = 0
    committed_rollouts: int = 0
    abandoned_rollouts: int = 0
    discarded_rollouts: int = 0
    committed_tokens: int = 0
    abandoned_tokens: int = 0
    discarded_tokens: int = 0
    prompt_tokens: int = 0
    prompts_drawn: int = 0
    stop_reason: str = ""
    target_groups: int = 0
    allocator_seconds: float = 0.0
    env_seconds: float = 0.0
    decisions: int = 0
    wrong_abandons: int | None = None
    effective_rollouts: int = 0
    aborted_rollouts: int = 0
    aborted_tokens: int = 0
    mean_inflight: float = 0.0
    carried_in_rollouts: int = 0
    carried_out_rollouts: int = 0
    carried_in_inflight: int = 0
    carried_out_inflight: int = 0

    def as_metrics(self, prefix: str = "alloc/") -> dict[str, float]:
        """Flat ``{prefix + name: value}`` dict of the numeric fields (for loggers)."""
        out: dict[str, float] = {}
        for name, value in self.__dict__.items():
            if isinstance(value, bool) or value is None or isinstance(value, str):
                continue
            out[prefix + name] = float(value)
        out[prefix + "waste_fraction"] = self.waste_fraction
        return out

    @property
    def waste_fraction(self) -> float:
        """Rollouts that carry no gradient signal (abandoned, discarded, saturated committed) / all rollouts."""
        return 1.0 - self.effective_rollouts / self.rollouts if self.rollouts else 0.0



@dataclass(frozen=True)
class CollectResult:
    """What a collection step returns: the training batch plus everything that was not used, and the accounting.

    Attributes:
        groups: Committed groups (the training batch), in commit order. May hold saturated groups (uniform
            allocation) and groups of any size (``as_is`` completion).
        abandoned: Abandoned units (partial groups), for analysis.
        discarded: Discarded units, for analysis.
        stats: Exact accounting.
    """

    groups: tuple[Group, ...]
    abandoned: tuple[Group, ...]
    discarded: tuple[Group, ...]
    stats: CollectStats
    carry: Any = None
    """Streaming carry-over: the open units and running rollouts handed to the next step (``sara.step.StreamCarry``;
    pass it as ``carry=`` to the next ``collect``), else None."""

    @property
    def rollouts(self) -> list[Rollout]:
        """All rollouts of the committed groups, flattened in group order."""
        return [r for g in self.groups for r in g.rollouts]

    def flat(self) -> tuple[np.ndarray, np.ndarray]:
        """Flat per-rollout ``(rewards [N] float64, group_ids [N] int64)`` of the committed groups."""
        rewards = np.fromiter((r.reward for g in self.groups for r in g.rollouts), dtype=np.float64)
        gids = np.fromiter((g.group_id for g in self.groups for _ in g.rollouts), dtype=np.int64)
        return rewards, gids
