"""The allocator protocol (``BudgetAllocator``): slots free up, the allocator says which units get them; results
arrive in any order, and the allocator commits, abandons or lets each unit continue.

One protocol for every driver mode (``sara.driver.collect``; an allocator never calls the environment)::

    begin_step(target_groups, step=..., max_rollouts=..., lookahead=...)
    loop:
        ids = dispatch(free)                 # unit ids (with repeats) of the rollouts to start now
        m = wants_prompts(idle)              # fresh prompts to admit when the open units leave slots idle
        admit(pool_indices)                  # -> new unit ids (then dispatch again)
        closed, decisions = finished(unit_ids, rewards, index)   # delivered rollouts, in any order
        abort(closed units that still have rollouts in flight)
    closed, decisions = end_step()           # close whatever is still open

Synchronous rounds are the same calls with a barrier: the driver dispatches a whole round, waits for all of it, and
hands every result to one ``finished`` call. State is a table of arrays over allocation units (``sara.units``); every
decision is vectorized over units. A unit is usually a prompt; tree allocators use trees of partial traces.

Subclasses implement ``demand`` (how many rollouts each open unit should have started by now), ``wants_prompts`` and
``observe`` (fold delivered rewards in and close units); ``sara.allocators.sequential`` is the template for stopping
rules, which then override ONE method, ``decide``.

The public methods are the protocol's boundary: each checks its arguments (``sara.allocators.boundary``) before it
changes anything, so a non-finite reward, a reward outside ``reward_range``, arrays of different lengths, an unknown
unit id or more rollouts delivered than a unit has in flight is a ``ProtocolError`` naming the rollout, whoever calls.
Subclasses extend the hooks behind them (``credit``, ``observe``) and call ``super()`` first where they extend a public
method, so the check stays in one place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, cast

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, Field, model_validator

from sara.allocators.boundary import ProtocolError, as_count, as_ids, check_rewards, check_same_length
from sara.config import SaraModel, validate_config
from sara.types import Decision
from sara.units import UnitStatus, UnitTable

__all__ = ["AllocatorConfig", "AllocatorInternals", "BudgetAllocator", "ProtocolError"]


class AllocatorInternals(SaraModel):
    """An allocator's internals: research knobs and constants, which a run rarely changes (``AllocatorConfig``'s
    ``internals``). A spec gives them as flat keys (``sara:eps=0.01``), as it gives the rule's own options."""

    eps: float = Field(1e-6, ge=0.0)
    """Effectiveness tolerance: a group is effective when its reward std exceeds eps (never ``std == 0``)."""


class AllocatorConfig(SaraModel):
    """Options every allocator has: the top-level fields are what a user decides, ``internals`` holds the rest.

    A key of the internals given flat (``{"eps": 0.01}``, a spec's ``sara:eps=0.01``) is moved under ``internals``
    before validation, so flat and nested data build the same config; a key given both ways is an error.
    """

    k: int = Field(8, ge=2, le=1_000_000)
    """Group size: rollouts per prompt in a full group. Must be >= 2 (a singleton group has no baseline). In a
    training run it comes from ``TrainConfig.k``; an allocator spec that sets another value is an error."""
    internals: AllocatorInternals = Field(default_factory=AllocatorInternals)
    """Research knobs and constants (``AllocatorInternals``); a spec gives them flat."""

    @classmethod
    def internals_model(cls) -> type[AllocatorInternals]:
        """The model of this config's ``internals`` (the annotation of its field: a subclass narrows it)."""
        return cast(type[AllocatorInternals], cls.model_fields["internals"].annotation)

    @classmethod
    def option_names(cls) -> list[str]:
        """The options a spec may give: the top-level fields, then the internals' (flat, as a spec gives them)."""
        top = [name for name in cls.model_fields if name != "internals"]
        return top + [name for name in cls.internals_model().model_fields if name not in cls.model_fields]

    @classmethod
    def option_at(cls, loc: Sequence[int | str]) -> str:
        """An error under ``internals`` names the option flat, as a spec gives it (``eps``, not ``internals.eps``)."""
        return super().option_at(loc[1:] if len(loc) > 1 and loc[0] == "internals" else loc)

    @classmethod
    def flatten(cls, data: Mapping[str, object]) -> dict[str, object]:
        """``data`` with its ``internals`` (a mapping or a model) spread as flat keys after the others."""
        out = {key: value for key, value in data.items() if key != "internals"}
        nested = data.get("internals")
        if isinstance(nested, BaseModel):
            nested = nested.model_dump()
        if isinstance(nested, Mapping):
            out.update(nested)
        elif nested is not None:
            out["internals"] = nested
        return out

    def spec_options(self) -> dict[str, object]:
        """Every option by the name a spec gives it: the top-level fields, then the internals'."""
        return self.flatten(self.model_dump())

    @model_validator(mode="before")
    @classmethod
    def _nest_internals(cls, data: Any) -> Any:
        """Move each key that is a field of the internals (and not a top-level field) under ``internals``, merged
        with an ``internals`` mapping given; a key given both ways is an error naming it."""
        if not isinstance(data, Mapping):
            return data
        inner = cls.internals_model().model_fields
        flat = {key: value for key, value in data.items() if key in inner and key not in cls.model_fields}
        if not flat:
            return data
        nested = data.get("internals", {})
        if isinstance(nested, BaseModel):
            nested = nested.model_dump(exclude_unset=True)
        if not isinstance(nested, Mapping):
            return data  # not a mapping: pydantic refuses it, naming 'internals'
        both = sorted(set(flat) & set(nested))
        if both:
            raise ValueError(f"option(s) {', '.join(repr(b) for b in both)} given both flat and under 'internals'; "
                             "give each once")
        out = {key: value for key, value in data.items() if key not in flat}
        out["internals"] = {**nested, **flat}
        return out


class BudgetAllocator(ABC):
    """Decides which units get the next rollouts, and closes units with a ``Decision`` (see the module docstring).

    Subclasses set ``Config`` (a pydantic model) and register themselves with ``sara.allocators.register``.
    Per-step state lives in ``self.units``; cross-step state (counters, priors) goes through ``state_dict``.
    """

    name: ClassVar[str] = "base"
    Config: ClassVar[type[AllocatorConfig]] = AllocatorConfig
    carries_over: ClassVar[bool] = True
    """Whether open units can be handed to the next step (``carry_out`` / ``carry_in``; ``DriverConfig.carry_lag``)."""

    def __init__(self, config: AllocatorConfig | Mapping[str, Any] | None = None, **overrides: object) -> None:
        if config is None or isinstance(config, Mapping):
            data = dict(config or {})
            data.update(overrides)
            config = validate_config(self.Config, data, what=f"allocator {self.name!r}")
        elif overrides:
            given = self.Config.flatten(config.model_dump(exclude_unset=True))  # defaults stay defaults (group_by)
            config = validate_config(self.Config, {**given, **self.Config.flatten(overrides)},
                                     what=f"allocator {self.name!r}")
        self.config = config
        self.units = UnitTable()
        self.target_groups = 0
        self.lookahead = 0
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
        return self.config.internals.eps

    @property
    def reward_range(self) -> tuple[float, float]:
        """``(low, high)``: the rewards this allocator accepts (inclusive; infinite ends: any finite reward). A
        delivered reward outside it, or not finite, is a ``ProtocolError``."""
        return (-np.inf, np.inf)

    def _who(self, method: str) -> str:
        return f"allocator {self.name!r} ({type(self).__name__}).{method}"

    def _ids(self, unit_ids: np.ndarray, method: str) -> npt.NDArray[np.int64]:
        """``unit_ids`` checked to be ids of this step's units."""
        return as_ids(unit_ids, self._who(method), "unit_ids", below=len(self.units))

    # ---- the protocol ----------------------------------------------------------------------------------------
    def begin_step(self, target_groups: int, *, step: int | None = None, max_rollouts: int | None = None,
                   lookahead: int = 0) -> None:
        """Start a step that aims at ``target_groups`` committed groups within ``max_rollouts``; ``lookahead``: groups
        to work ahead for the next step (a driver that carries open units over)."""
        who = self._who("begin_step")
        target_groups, lookahead = as_count(target_groups, who, "target_groups"), as_count(lookahead, who, "lookahead")
        max_rollouts = None if max_rollouts is None else as_count(max_rollouts, who, "max_rollouts")
        step = None if step is None else as_count(step, who, "step")
        self.units = UnitTable()
        self.target_groups = target_groups
        self.lookahead = lookahead
        self.max_rollouts = max_rollouts
        self.step = self.step + 1 if step is None else step
        self._counters["steps"] += 1

    @abstractmethod
    def wants_prompts(self, idle: int) -> int:
        """Fresh prompts to admit now, when the open units leave ``idle`` slots without work (0 = none)."""

    def admit(self, pool_index: np.ndarray) -> np.ndarray:
        """Create one unit per fresh prompt; returns their unit ids."""
        pool_index = as_ids(pool_index, self._who("admit"), "pool_index")
        ids = self.units.add(pool_index, prior=self.prior_params(pool_index))
        self._counters["units"] += len(ids)
        return ids

    def prior_params(self, pool_index: np.ndarray) -> dict[str, np.ndarray] | None:
        """Per-unit prior parameters for admitted prompts (None = no prior)."""
        return None

    @abstractmethod
    def demand(self) -> tuple[np.ndarray, np.ndarray]:
        """``(unit_ids, want)``: rollouts each open unit should have in flight now (in dispatch order)."""

    def dispatch(self, free: int, only: np.ndarray | None = None) -> np.ndarray:
        """Unit ids (with repeats, in ``demand`` order) of up to ``free`` rollouts to start now (among the units
        ``only`` when given); marks them in flight."""
        if not (isinstance(free, (int, np.integer)) and not isinstance(free, (bool, np.bool_)) and free < 0):
            free = as_count(free, self._who("dispatch"), "free")  # a negative whole number asks for nothing
        only = None if only is None else self._ids(only, "dispatch")
        u = self.units
        if free <= 0 or len(u) == 0:
            return np.zeros(0, np.int64)
        ids, want = self.demand()
        need = np.maximum(want - u.inflight[ids], 0)
        if only is not None:
            need = np.where(np.isin(ids, only), need, 0)
        ids = np.repeat(ids, need)[:free]
        np.add.at(u.inflight, ids, 1)
        return ids

    def prefix(self, unit_ids: np.ndarray) -> list[str]:
        """Text appended to each just-dispatched rollout's prompt before generation (trees); default none."""
        return [""] * len(unit_ids)

    def finished(self, unit_ids: np.ndarray, rewards: np.ndarray, index: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Fold delivered rollouts in (``unit_ids`` may repeat; ``index``: each rollout's index within its unit) and
        return ``(unit_ids, decisions)`` of the units closed now.

        Raises:
            ProtocolError: arrays of different lengths, an id that is not a unit of this step, more rollouts of a unit
                than it has in flight, a negative index, or a reward that is not finite or outside ``reward_range``;
                nothing is folded in then.
        """
        who = self._who("finished")
        unit_ids = self._ids(unit_ids, "finished")
        check_same_length(who, unit_ids=unit_ids, rewards=np.atleast_1d(np.asarray(rewards, dtype=object)),
                          index=None if index is None else np.atleast_1d(np.asarray(index, dtype=object)))
        index = None if index is None else as_ids(index, who, "index")
        u = self.units

        def where(i: int) -> str:
            j = "" if index is None else f" {int(index[i])}"
            return f"rollout{j} of unit {int(unit_ids[i])} (prompt {int(u.pool_index[unit_ids[i]])})"

        rewards = check_rewards(rewards, who, self.reward_range, where)
        ids, counts = np.unique(unit_ids, return_counts=True)
        over = counts > u.inflight[ids]
        if over.any():
            b = int(ids[over][0])
            raise ProtocolError(f"{who}: {int(counts[over][0])} rollouts of unit {b} (prompt {int(u.pool_index[b])}) "
                                f"delivered, {int(u.inflight[b])} in flight; deliver each dispatched rollout once, "
                                "and none of a unit after abort / carry_out")
        self.credit(unit_ids, index)
        np.subtract.at(u.inflight, unit_ids, 1)
        return self.observe(unit_ids, rewards)

    def credit(self, unit_ids: np.ndarray, index: np.ndarray | None) -> None:
        """Hook of ``finished``, called with its checked arguments before ``observe``: per-rollout bookkeeping by
        ``index`` (trees credit each leaf to its node). Default: nothing."""
        return None

    @abstractmethod
    def observe(self, unit_ids: np.ndarray, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Fold delivered rewards in and close units: ``(unit_ids, decisions)`` with ``Decision.COMMIT`` /
        ``ABANDON`` / ``DISCARD`` codes (``np.int8``). State follows observations: a unit may get fewer rollouts
        than dispatched (budget cut, aborts)."""

    def abort(self, unit_ids: np.ndarray) -> None:
        """Forget the in-flight rollouts of ``unit_ids`` (the driver cancelled them)."""
        self.units.inflight[self._ids(unit_ids, "abort")] = 0

    def inflight(self, unit_ids: np.ndarray) -> np.ndarray:
        """Rollouts in flight per unit."""
        return self.units.inflight[self._ids(unit_ids, "inflight")]

    def filling(self) -> np.ndarray:
        """Units being filled: committed, with fewer than k rollouts delivered."""
        return np.flatnonzero(self.units.status == UnitStatus.FILLING)

    def needed(self) -> int:
        """Groups still needed: target (+ ``lookahead``) minus units committed or committed-and-filling."""
        st = self.units.status
        won = int(((st == UnitStatus.COMMITTED) | (st == UnitStatus.FILLING)).sum())
        return max(0, self.target_groups + self.lookahead - won)

    def end_step(self) -> tuple[np.ndarray, np.ndarray]:
        """Close every open unit (default: ``DISCARD``) and return them as ``(unit_ids, decisions)``."""
        open_ = np.flatnonzero(self.units.status <= UnitStatus.FILLING)
        return open_, self._close(open_, Decision.DISCARD)

    # ---- carry-over: open units handed from one step to the next -------------------------------------------------
    def carry_out(self, unit_ids: np.ndarray) -> None:
        """Hand open units to the next step: they are not closed by ``end_step`` and not in ``observations``."""
        unit_ids = self._ids(unit_ids, "carry_out")
        self.units.status[unit_ids] = UnitStatus.CARRIED
        self.units.inflight[unit_ids] = 0

    def carry_in(self, pool_index: np.ndarray, rewards: list[np.ndarray], inflight: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Re-admit units carried from the previous step before any ``admit`` of this one: their delivered
        ``rewards`` (one array per unit) are replayed through ``observe`` (decided under this step's prior);
        ``inflight`` rollouts per unit are still running.

        Returns:
            ``(unit_ids, closed, decisions)``: the new unit ids, and the units the replay closed.

        Raises:
            ProtocolError: ``pool_index``, ``rewards`` and ``inflight`` of different lengths, or a bad reward (as in
                ``finished``); nothing is admitted then.
        """
        who = self._who("carry_in")
        pool_index = as_ids(pool_index, who, "pool_index")
        check_same_length(who, pool_index=pool_index, rewards=rewards, inflight=np.atleast_1d(np.asarray(inflight)))
        inflight = as_ids(inflight, who, "inflight")
        lens = np.fromiter((len(np.atleast_1d(r)) for r in rewards), np.int64, count=len(rewards))
        of = np.repeat(np.arange(len(lens)), lens)
        flat = check_rewards(np.concatenate([np.atleast_1d(np.asarray(r)) for r in rewards]) if len(rewards)
                             else np.zeros(0), who, self.reward_range,
                             lambda i: f"carried rollout of unit {int(of[i])} (prompt {int(pool_index[of[i]])})")
        ids = self.admit(pool_index)
        self._counters["units"] -= len(ids)  # admitted (and counted) once already
        self.units.inflight[ids] = inflight
        if lens.sum() == 0:
            return ids, np.zeros(0, np.int64), np.zeros(0, np.int8)
        closed, decisions = self.observe(np.repeat(ids, lens), flat)
        self._counters["rollouts"] -= int(lens.sum())  # counted when delivered
        return ids, closed, decisions

    # ---- what drivers and samplers read ----------------------------------------------------------------------
    def pool_indices(self, unit_ids: np.ndarray) -> np.ndarray:
        """Prompt index in the pool of each unit."""
        return self.units.pool_index[self._ids(unit_ids, "pool_indices")]

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
        return max(0, -(-spare // self.k))  # ceil: the last unit may get a partial budget (cut by the driver)

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

    def __repr__(self) -> str:
        opts = ",".join(f"{k}={'/'.join(map(str, v)) if isinstance(v, tuple) else v}"
                        for k, v in self.config.spec_options().items())  # as a spec gives them (probe=2/1)
        return f"{type(self).__name__}({opts})"
