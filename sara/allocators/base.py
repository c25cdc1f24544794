"""The allocator interface and the sequential template.

Lifecycle of one collection step (driven by ``sara.collect``; an allocator never calls the environment)::

    begin_step(target_groups)
    loop:
        m = wants_prompts()              # fresh prompts to admit now
        admit(pool_indices)              # -> new unit ids
        unit_ids, counts = plan()        # rollouts per unit in this round (ONE batched env call)
        closed_ids, decisions = observe(unit_ids_flat, rewards_flat)
    closed_ids, decisions = end_step()   # close whatever is still open

State is a table of arrays over allocation units (``UnitTable``); every decision is computed vectorized over units.
A unit is usually a prompt; tree allocators use nodes of a rollout tree (``prefix``), nothing in the loop changes.

Writing a new stopping rule: subclass ``SequentialAllocator`` and override ONE method, ``decide``::

    class AbandonAfterM(SequentialAllocator):
        def decide(self, units):            # units: UnitView over the undecided, unmixed units
            return np.where(units.n >= 3, Decision.ABANDON, Decision.CONTINUE)
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from sara.allocators.admission import CommitPaths, record_probe
from sara.config import SaraModel, validate_config
from sara.types import Decision

__all__ = [
    "AllocatorConfig",
    "SequentialConfig",
    "BudgetAllocator",
    "SequentialAllocator",
    "UnitTable",
    "UnitView",
    "UnitStatus",
    "EffectivenessModel",
    "BinaryEffectiveness",
    "Prior",
    "ConstantPrior",
]


class AllocatorConfig(SaraModel):
    """Options every allocator has."""

    k: int = Field(8, ge=2, le=1_000_000)
    """Group size: rollouts per prompt in a full group. Must be >= 2 (a singleton group has no baseline)."""
    eps: float = Field(1e-6, ge=0.0)
    """Effectiveness tolerance: a group is effective when its reward std exceeds eps (never ``std == 0``)."""


class UnitStatus:
    """Status codes of the unit table (``np.int8``)."""

    PROBING = 0
    FILLING = 1
    COMMITTED = 2
    ABANDONED = 3
    DISCARDED = 4


@dataclass
class UnitTable:
    """Per-unit arrays of one step. Unit ids are row indices (0, 1, 2, ... in admission order).

    Attributes:
        pool_index: Prompt index in the pool, ``[M] int64``.
        n: Rollouts observed, ``[M] int64``.
        rsum: Sum of rewards, ``[M] float64`` (successes for binary rewards).
        rsq: Sum of squared rewards, ``[M] float64``.
        rmin / rmax: Running min / max reward, ``[M] float64``.
        status: ``UnitStatus`` code, ``[M] int8``.
        probes: Probing rounds the unit has been through, ``[M] int64``.
        prior: Per-unit prior parameters (e.g. ``{"alpha0": [M], "beta0": [M]}``), set at admission.
        extra: Free per-unit arrays for subclasses (tree parent ids, depth, ...).
    """

    pool_index: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    n: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    rsum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    rsq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    rmin: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    rmax: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    status: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    probes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prior: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.n)

    def add(self, pool_index: np.ndarray, prior: Mapping[str, np.ndarray] | None = None,
            extra: Mapping[str, np.ndarray] | None = None) -> np.ndarray:
        """Append units for ``pool_index``; returns their unit ids."""
        m = len(pool_index)
        start = len(self)
        self.pool_index = np.concatenate([self.pool_index, np.asarray(pool_index, np.int64)])
        self.n = np.concatenate([self.n, np.zeros(m, np.int64)])
        self.rsum = np.concatenate([self.rsum, np.zeros(m)])
        self.rsq = np.concatenate([self.rsq, np.zeros(m)])
        self.rmin = np.concatenate([self.rmin, np.full(m, np.inf)])
        self.rmax = np.concatenate([self.rmax, np.full(m, -np.inf)])
        self.status = np.concatenate([self.status, np.zeros(m, np.int8)])
        self.probes = np.concatenate([self.probes, np.zeros(m, np.int64)])
        for table, given in ((self.prior, prior or {}), (self.extra, extra or {})):
            for key in set(table) | set(given):
                new = np.broadcast_to(np.asarray(given[key]), (m,)) if key in given else np.zeros(m)
                old = table.get(key, np.zeros(start, new.dtype))
                table[key] = np.concatenate([old, new.astype(old.dtype, copy=False)])
        return np.arange(start, start + m, dtype=np.int64)

    def update(self, unit_ids: np.ndarray, rewards: np.ndarray) -> np.ndarray:
        """Fold flat observations into the sufficient statistics; returns the distinct touched unit ids."""
        unit_ids = np.asarray(unit_ids, np.int64)
        rewards = np.asarray(rewards, np.float64)
        np.add.at(self.n, unit_ids, 1)
        np.add.at(self.rsum, unit_ids, rewards)
        np.add.at(self.rsq, unit_ids, rewards * rewards)
        np.minimum.at(self.rmin, unit_ids, rewards)
        np.maximum.at(self.rmax, unit_ids, rewards)
        return np.unique(unit_ids)

    def std(self, idx: np.ndarray) -> np.ndarray:
        """Population std of each unit's rewards so far."""
        n = np.maximum(self.n[idx], 1)
        mean = self.rsum[idx] / n
        return np.sqrt(np.maximum(self.rsq[idx] / n - mean * mean, 0.0))


@dataclass(frozen=True)
class UnitView:
    """Read-only view of some units handed to ``SequentialAllocator.decide``.

    Attributes:
        ids: Unit ids ``[m]``.
        n: Rollouts observed ``[m]``.
        s: Reward sums ``[m]`` (successes for binary rewards).
        k: Full group size.
        p_eff: Predictive probability that the completed group is effective ``[m]`` (from the effectiveness model).
        table: The whole unit table (for rules that need more columns).
    """

    ids: np.ndarray
    n: np.ndarray
    s: np.ndarray
    k: int
    p_eff: np.ndarray
    table: UnitTable


class EffectivenessModel(ABC):
    """Turns a unit's sufficient statistics into (a) 'already effective?' and (b) P(completed group effective).

    The binary Beta-Binomial model is one implementation; continuous rewards plug in another, nothing else changes.
    """

    @abstractmethod
    def is_mixed(self, table: UnitTable, idx: np.ndarray, eps: float) -> np.ndarray:
        """Boolean ``[len(idx)]``: the observed prefix is already an effective group."""

    @abstractmethod
    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray:
        """Float ``[len(idx)]``: probability that the completed size-k group is effective."""


class BinaryEffectiveness(EffectivenessModel):
    """0/1 rewards, Beta(alpha0, beta0) prior per unit (``table.prior``), closed-form ``p_effective``."""

    def is_mixed(self, table: UnitTable, idx: np.ndarray, eps: float) -> np.ndarray:
        return (table.rmax[idx] - table.rmin[idx]) > eps

    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray:
        from sara.allocators.posteriors import p_effective

        a = table.prior.get("alpha0", np.ones(len(table)))[idx]
        b = table.prior.get("beta0", np.ones(len(table)))[idx]
        # Binary: successes = reward sum (rewards are rounded to {0,1} by construction of the task).
        return np.asarray(p_effective(table.n[idx], np.rint(table.rsum[idx]), k, a, b), dtype=np.float64)


class Prior(ABC):
    """Where a unit's prior comes from (constant, empirical Bayes, per-prompt history, ...)."""

    @abstractmethod
    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        """Per-unit prior parameters, e.g. ``{"alpha0": [m], "beta0": [m]}``."""

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:  # noqa: B027
        """Learn from one finished step's observations (every unit, all decisions). Default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027
        pass


class ConstantPrior(Prior):
    """The same Beta(alpha0, beta0) for every prompt (the paper's uniform prior is alpha0 = beta0 = 1)."""

    def __init__(self, alpha0: float = 1.0, beta0: float = 1.0) -> None:
        self.alpha0 = float(alpha0)
        self.beta0 = float(beta0)

    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        m = len(pool_index)
        return {"alpha0": np.full(m, self.alpha0), "beta0": np.full(m, self.beta0)}


class BudgetAllocator(ABC):
    """Decides, round by round, which units get how many rollouts, and closes units with a ``Decision``.

    Subclasses set ``Config`` (a pydantic model) and register themselves with ``sara.allocators.register``.
    Per-step state lives in ``self.units``; cross-step state (counters, priors) goes through ``state_dict``.
    """

    name: ClassVar[str] = "base"
    Config: ClassVar[type[AllocatorConfig]] = AllocatorConfig

    def __init__(self, config: AllocatorConfig | Mapping[str, Any] | None = None, **overrides: Any) -> None:
        if config is None or isinstance(config, Mapping):
            data = dict(config or {})
            data.update(overrides)
            config = validate_config(self.Config, data, what=f"allocator {self.name!r}")
        elif overrides:
            config = validate_config(self.Config, {**config.model_dump(), **overrides}, what=f"allocator {self.name!r}")
        self.config = config
        self.units = UnitTable()
        self.target_groups = 0
        self.max_rollouts: int | None = None
        self.step = -1
        self._counters: dict[str, float] = {
            "steps": 0, "units": 0, "committed": 0, "abandoned": 0, "discarded": 0, "rollouts": 0, "decisions": 0,
        }

    @property
    def k(self) -> int:
        return self.config.k

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def begin_step(self, target_groups: int, step: int | None = None, max_rollouts: int | None = None) -> None:
        """Start a collection step that aims at ``target_groups`` committed groups within ``max_rollouts``."""
        self.units = UnitTable()
        self.target_groups = int(target_groups)
        self.max_rollouts = None if max_rollouts is None else int(max_rollouts)
        self.step = self.step + 1 if step is None else int(step)
        self._counters["steps"] += 1

    @abstractmethod
    def wants_prompts(self) -> int:
        """How many fresh prompts to admit before the next round (0 = none)."""

    def admit(self, pool_index: np.ndarray) -> np.ndarray:
        """Create one unit per fresh prompt; returns their unit ids."""
        ids = self.units.add(np.asarray(pool_index, np.int64), prior=self.prior_params(np.asarray(pool_index)))
        self._counters["units"] += len(ids)
        return ids

    def prior_params(self, pool_index: np.ndarray) -> dict[str, np.ndarray] | None:
        """Per-unit prior parameters for admitted prompts (None = no prior)."""
        return None

    @abstractmethod
    def plan(self) -> tuple[np.ndarray, np.ndarray]:
        """``(unit_ids, counts)``: rollouts per unit for this round. Empty = nothing left to do."""

    @abstractmethod
    def observe(self, unit_ids: np.ndarray, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fold one round's flat observations in; return ``(unit_ids, decisions)`` of the units closed now.

        ``decisions`` holds ``Decision.COMMIT`` / ``ABANDON`` / ``DISCARD`` codes (``np.int8``). The collect loop
        may deliver fewer rollouts than planned (budget cut), so state must follow observations, not the plan.
        """

    def end_step(self) -> tuple[np.ndarray, np.ndarray]:
        """Close every open unit (default: ``DISCARD``) and return them as ``(unit_ids, decisions)``."""
        open_ = np.flatnonzero(self.units.status <= UnitStatus.FILLING)
        return open_, self._close(open_, Decision.DISCARD)

    def prefix(self, unit_ids: np.ndarray) -> list[str]:
        """Text appended to each unit's prompt before generation (tree rollouts); default none."""
        return [""] * len(unit_ids)

    # ---- bookkeeping shared by subclasses -------------------------------------------------------------------
    def _close(self, idx: np.ndarray, decision: Decision | np.ndarray) -> np.ndarray:
        """Mark units closed with ``decision`` (scalar or per unit) and count; returns the decision array."""
        idx = np.asarray(idx, np.int64)
        dec = np.broadcast_to(np.asarray(decision, np.int8), idx.shape).copy()
        status_of = np.array([-1, UnitStatus.COMMITTED, UnitStatus.ABANDONED, UnitStatus.DISCARDED], np.int8)
        self.units.status[idx] = status_of[dec]
        self._counters["committed"] += int((dec == Decision.COMMIT).sum())
        self._counters["abandoned"] += int((dec == Decision.ABANDON).sum())
        self._counters["discarded"] += int((dec == Decision.DISCARD).sum())
        return dec

    def _affordable_units(self) -> int | None:
        """Fresh units the step's rollout budget can still pay a full group for, after reserving ``k - n`` rollouts
        for every open unit (the paper's fixed-budget semantics: a prompt holds a budget of k; abandoning frees the
        rest). None = no budget."""
        if self.max_rollouts is None:
            return None
        u = self.units
        open_ = u.status <= UnitStatus.FILLING
        spare = self.max_rollouts - int(u.n.sum()) - int((self.k - u.n[open_]).clip(min=0).sum())
        return max(0, -(-spare // self.k))  # ceil: the last unit may get a partial budget (cut by collect)

    def _needed(self) -> int:
        """Groups still needed: target minus units committed or committed-and-filling."""
        st = self.units.status
        return max(0, self.target_groups - int(((st == UnitStatus.COMMITTED) | (st == UnitStatus.FILLING)).sum()))

    # ---- state ---------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Cumulative counters as a flat ``alloc/...`` dict."""
        return {f"alloc/{k}": float(v) for k, v in self._counters.items()}

    def state_dict(self) -> dict[str, Any]:
        """Cross-step state (config, counters, step, and subclass extras). Picklable, numpy/str/float only."""
        return {"config": self.config.model_dump(), "counters": dict(self._counters), "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.config = self.Config.model_validate(state["config"])
        self._counters = dict(state["counters"])
        self.step = int(state["step"])

    def clone(self) -> BudgetAllocator:
        """A deep copy with the same config and state."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.config.model_dump().items())
        return f"{type(self).__name__}({opts})"


class SequentialConfig(AllocatorConfig):
    """Options of the sequential (probe, then commit / abandon / continue) template."""

    probe: tuple[int, ...] = (1,)
    """Probe schedule: rollouts a probing unit gets in its 1st, 2nd, ... round (last entry repeats). '1' is fully
    sequential; '2/1' probes two first, then one at a time. In spec strings separate entries with '/'."""
    completion: Literal["complete", "as_is"] = "complete"
    """'complete': a committed group is filled up to k rollouts. 'as_is': it is kept at the size it has (variable-size
    groups, always >= 2 when committed because it is mixed)."""
    oversample: float | Literal["auto"] = "auto"
    """Units probed in parallel = ceil(groups still needed x oversample). 'auto' admits fresh units until the expected
    commits of all units in flight cover the groups still needed, with P(commit) estimated from the units' probing
    paths (``sara.allocators.admission``), so the units in flight are expected to fill the target and a step takes a
    few rounds. 1.0 probes only as many units as groups are still needed (no surplus, but a long tail of rounds).
    Units that mix in the round that reaches the target are kept and filled to k (surplus committed groups); once the
    groups committed or being filled cover the target, nothing is probed any more and the rest is discarded."""
    alpha0: float = Field(1.0, gt=0.0)
    """Beta prior pseudo-successes (1.0 with beta0 = 1.0 is the paper's uniform prior)."""
    beta0: float = Field(1.0, gt=0.0)
    """Beta prior pseudo-failures."""

    @field_validator("oversample")
    @classmethod
    def _check_oversample(cls, v: float | str) -> float | str:
        if v != "auto" and not 1.0 <= float(v) <= 64.0:
            raise ValueError("oversample must be 'auto' or a number in [1, 64]")
        return v

    @field_validator("probe", mode="before")
    @classmethod
    def _parse_probe(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [x for x in v.replace(" ", "").split("/") if x]
        if isinstance(v, int):
            v = [v]
        return v

    @field_validator("probe")
    @classmethod
    def _check_probe(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or any(x < 1 for x in v):
            raise ValueError("every probe entry must be an integer >= 1, e.g. probe=1 or probe=2/1")
        return v


class SequentialAllocator(BudgetAllocator):
    """Template for sequential stopping rules: probe units in rounds, commit mixed ones, ask ``decide`` for the rest.

    Per round and unit: a mixed prefix is committed (and filled to k in ``complete`` mode); a prefix that reached k
    without mixing is a saturated group and is discarded; every other unit gets ``decide(units)``: ``CONTINUE``,
    ``COMMIT`` (stop probing, fill the group in one go) or ``ABANDON`` (free the rest of its budget).
    """

    name = "sequential"
    Config = SequentialConfig
    model: EffectivenessModel = BinaryEffectiveness()

    def __init__(self, config: SequentialConfig | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self.prior: Prior = prior if prior is not None else ConstantPrior(self.config.alpha0, self.config.beta0)
        self._paths = CommitPaths()  # P(commit) of fresh and in-flight units, sizes oversample='auto'

    # The one hook ------------------------------------------------------------------------------------------------
    def decide(self, units: UnitView) -> np.ndarray:
        """Decision codes ``[len(units.ids)]`` for undecided units whose prefix is not mixed. Default: continue."""
        return np.full(len(units.ids), Decision.CONTINUE, np.int8)

    # Template -------------------------------------------------------------------------------------------------
    def prior_params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        return self.prior.params(pool_index)

    def wants_prompts(self) -> int:
        u = self.units
        probing = u.status == UnitStatus.PROBING
        factor = self.config.oversample
        if factor == "auto":
            # Admit enough fresh units that the expected commits of the units in flight and of the fresh ones cover
            # the groups still needed; P(commit) from the units' probing paths (``sara.allocators.admission``).
            p_fresh, q = self._paths.estimate(u, probing, self._won())
            want = max(0, math.ceil((self._needed() - float(q.sum())) / max(p_fresh, 1.0 / 16.0) - 1e-9))
        else:
            want = max(0, math.ceil(self._needed() * float(factor)) - int(probing.sum()))
        cap = self._affordable_units()
        return want if cap is None else min(want, cap)

    def commit_fraction(self) -> float:
        """Estimated probability that a fresh unit ends committed (``sara.allocators.admission``)."""
        u = self.units
        return self._paths.estimate(u, u.status == UnitStatus.PROBING, self._won())[0]

    def _won(self) -> np.ndarray:
        st = self.units.status
        return (st == UnitStatus.COMMITTED) | (st == UnitStatus.FILLING)

    def plan(self) -> tuple[np.ndarray, np.ndarray]:
        u, k = self.units, self.k
        filling = np.flatnonzero(u.status == UnitStatus.FILLING)
        probing = np.flatnonzero(u.status == UnitStatus.PROBING)
        if self._needed() == 0:
            # The groups being filled complete the target: only fill them. Probing on would commit surplus groups
            # that the step's end cuts short (partial groups that flatter rollouts per effective group).
            probing = probing[:0]
        sched = np.asarray(self.config.probe, np.int64)
        want = sched[np.minimum(u.probes[probing], len(sched) - 1)]
        counts = np.concatenate([k - u.n[filling], np.minimum(want, k - u.n[probing])])
        ids = np.concatenate([filling, probing])
        keep = counts > 0
        return ids[keep], counts[keep]

    def observe(self, unit_ids: np.ndarray, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        u, k, eps = self.units, self.k, self.config.eps
        touched = u.update(unit_ids, rewards)
        self._counters["rollouts"] += len(rewards)
        closed: list[np.ndarray] = []
        decisions: list[np.ndarray] = []

        # Filling units that are complete go to the batch.
        fill = touched[(u.status[touched] == UnitStatus.FILLING) & (u.n[touched] >= k)]
        closed.append(fill)
        decisions.append(self._close(fill, Decision.COMMIT))

        probing = touched[u.status[touched] == UnitStatus.PROBING]
        u.probes[probing] += 1
        self._counters["decisions"] += len(probing)
        mixed = self.model.is_mixed(u, probing, eps)
        record_probe(u, probing, mixed)
        commit_now = probing[mixed]
        rest = probing[~mixed]
        full = rest[u.n[rest] >= k]  # saturated complete group: no signal
        closed.append(full)
        decisions.append(self._close(full, Decision.DISCARD))
        rest = rest[u.n[rest] < k]
        if len(rest):
            view = UnitView(ids=rest, n=u.n[rest], s=u.rsum[rest], k=k,
                            p_eff=self.model.p_effective(u, rest, k), table=u)
            d = np.asarray(self.decide(view), np.int8)
            if d.shape != rest.shape:
                raise ValueError(f"{type(self).__name__}.decide returned shape {d.shape}, expected {rest.shape}")
            commit_now = np.concatenate([commit_now, rest[d == Decision.COMMIT]])
            ab = rest[d == Decision.ABANDON]
            closed.append(ab)
            decisions.append(self._close(ab, Decision.ABANDON))
            bad = ~np.isin(d, (Decision.CONTINUE, Decision.COMMIT, Decision.ABANDON))
            if bad.any():
                raise ValueError(f"{type(self).__name__}.decide may return CONTINUE, COMMIT or ABANDON, got {d[bad][:3]}")
        # Commit: fill to k, or keep as is (always when already complete).
        done = (u.n[commit_now] >= k) | (self.config.completion == "as_is")
        closed.append(commit_now[done])
        decisions.append(self._close(commit_now[done], Decision.COMMIT))
        u.status[commit_now[~done]] = UnitStatus.FILLING
        return np.concatenate(closed), np.concatenate(decisions).astype(np.int8)

    def end_step(self) -> tuple[np.ndarray, np.ndarray]:
        u = self.units
        # Learn from the step's paths before the units still probing are closed: they are censored, not failures
        # (counting them as failures made the estimate, and with it the surplus, feed on itself).
        self._paths.end_step(u, u.status == UnitStatus.PROBING, self._won())
        # A committed group cut short by the budget is still a valid (smaller) group: commit it as is.
        filling = np.flatnonzero(u.status == UnitStatus.FILLING)
        d_fill = self._close(filling, Decision.COMMIT)
        probing = np.flatnonzero(u.status == UnitStatus.PROBING)
        d_probe = self._close(probing, Decision.DISCARD)
        self.prior.update(u.pool_index, u.n, u.rsum, self.step)
        return np.concatenate([filling, probing]), np.concatenate([d_fill, d_probe])

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["prior"] = self.prior.state_dict()
        state["commit_paths"] = self._paths.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.prior.load_state_dict(state.get("prior", {}))
        self._paths.load_state_dict(state.get("commit_paths", {}))
