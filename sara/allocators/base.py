"""The allocator interface (``BudgetAllocator``), effectiveness models and priors.

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

The unit table lives in ``sara.allocators.units``; the sequential template (probe, then commit / abandon /
continue) in ``sara.allocators.sequential``. Writing a new stopping rule: subclass ``SequentialAllocator`` and
override ONE method, ``decide``::

    class AbandonAfterM(SequentialAllocator):
        def decide(self, units):            # units: UnitView over the undecided, unmixed units
            return np.where(units.n >= 3, Decision.ABANDON, Decision.CONTINUE)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from pydantic import Field

from sara.allocators.units import UnitStatus, UnitTable, UnitView
from sara.config import SaraModel, validate_config
from sara.types import Decision

__all__ = [
    "AllocatorConfig",
    "BudgetAllocator",
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
    lookahead: int = 0
    """Groups wanted beyond the target: a streaming driver that carries open units into the next step sets it for
    the step (``sara.collect_stream``); 0 otherwise."""

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
        """Full group size."""
        return self.config.k

    @property
    def eps(self) -> float:
        """Effectiveness tolerance: a group is effective when its reward std exceeds it."""
        return self.config.eps

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

    # ---- what drivers read (``sara.collect``, ``sara.collect_async``) -------------------------------------------
    def pool_indices(self, unit_ids: np.ndarray) -> np.ndarray:
        """Prompt index in the pool of each unit."""
        return self.units.pool_index[np.asarray(unit_ids, np.int64)]

    def observations(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(pool_index, n, rsum)`` of every unit of the step, in unit-id order (copies; for prompt samplers)."""
        u = self.units
        gone = u.status == UnitStatus.CARRIED  # counted in the step that closes them (they are re-admitted there)
        return u.pool_index.copy(), np.where(gone, 0, u.n), np.where(gone, 0.0, u.rsum)

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
        """Groups still needed: target (+ ``lookahead``) minus units committed or committed-and-filling."""
        st = self.units.status
        won = int(((st == UnitStatus.COMMITTED) | (st == UnitStatus.FILLING)).sum())
        return max(0, self.target_groups + self.lookahead - won)

    # ---- state ---------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Cumulative counters as a flat ``alloc/...`` dict."""
        return {f"alloc/{k}": float(v) for k, v in self._counters.items()}

    def state_dict(self) -> dict[str, Any]:
        """Cross-step state (config, counters, step, and subclass extras). Picklable, numpy/str/float only."""
        # Only the fields the user set: re-validating a full dump would mark defaults as given (SARA reads a given
        # tau_low as "the paper rule").
        return {"config": self.config.model_dump(exclude_unset=True), "counters": dict(self._counters),
                "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.config = self.Config.model_validate(state["config"])
        self._counters = dict(state["counters"])
        self.step = int(state["step"])

    def __repr__(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in self.config.model_dump().items())
        return f"{type(self).__name__}({opts})"


def __getattr__(name: str) -> Any:
    # The sequential template lives in ``sara.allocators.sequential`` (which imports this module); kept importable here.
    if name in ("SequentialAllocator", "SequentialConfig"):
        from sara.allocators import sequential

        return getattr(sequential, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
