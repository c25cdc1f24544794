"""The sequential template: probe units a few rollouts at a time, commit mixed ones, ask ONE hook (``decide``) about
the rest.

Writing a new stopping rule: subclass ``SequentialAllocator`` and override ``decide``::

    import numpy as np
    from sara import Decision, SequentialAllocator

    class AbandonAfterM(SequentialAllocator):
        def decide(self, units):            # units: UnitView over the undecided, unmixed units
            return np.where(units.n >= 3, Decision.ABANDON, Decision.CONTINUE)

Per unit: a probing unit has up to its probe-schedule entry of rollouts in flight (``probe=1``: decide after every
single rollout); a mixed prefix is committed (and filled to k in ``complete`` mode); a prefix that reached k without
mixing is a saturated group and is discarded; every other unit gets ``decide``: ``CONTINUE``, ``COMMIT`` (stop
probing, fill the group in one go) or ``ABANDON`` (free the rest of its budget). Once the groups committed or being
filled cover the target, nothing is probed any more: the units ``drain`` selects get all their remaining rollouts
(complete groups, as DS would generate them), the others none (discarded at the step's end).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Protocol, cast

import numpy as np
from pydantic import Field, field_validator

from sara.allocators.admission import CommitPaths, record_probe
from sara.allocators.base import AllocatorConfig, AllocatorInternals, BudgetAllocator
from sara.allocators.effectiveness import BinaryEffectiveness, EffectivenessModel
from sara.priors.base import ConstantPrior, Prior
from sara.types import Decision
from sara.units import UnitStatus, UnitView

__all__ = ["SequentialAllocator", "SequentialConfig", "SequentialInternals"]


class SequentialInternals(AllocatorInternals):
    """Internals of the sequential template: the probe schedule and the constant prior's parameters."""

    probe: tuple[int, ...] = (1,)
    """Probe schedule: rollouts a probing unit gets in its 1st, 2nd, ... probe (last entry repeats); under a
    streaming driver, the rollouts it may have in flight at once. '1' is fully sequential; '2/1' probes two first,
    then one at a time. In spec strings separate entries with '/'."""
    alpha0: float = Field(1.0, gt=0.0)
    """Beta prior pseudo-successes (1.0 with beta0 = 1.0 is the paper's uniform prior)."""
    beta0: float = Field(1.0, gt=0.0)
    """Beta prior pseudo-failures."""

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


class SequentialConfig(AllocatorConfig):
    """Options of the sequential (probe, then commit / abandon / continue) template."""

    internals: SequentialInternals = Field(default_factory=SequentialInternals)
    """Research knobs and constants (``SequentialInternals``); a spec gives them flat (``probe=2/1``)."""
    completion: Literal["complete", "as_is"] = "complete"
    """'complete': a committed group is filled up to k rollouts. 'as_is': it is kept at the size it has (variable-size
    groups, always >= 2 when committed because it is mixed)."""
    oversample: float | Literal["auto"] = "auto"
    """Units probed in parallel = ceil(groups still needed x oversample). 'auto' admits fresh units until the expected
    commits of all units in flight cover the groups still needed, with P(commit) estimated from the units' probing
    paths (``sara.allocators.admission``), so the units in flight are expected to fill the target and a step takes a
    few rounds. 1.0 probes only as many units as groups are still needed (no surplus, but a long tail of rounds).
    Units that mix in the round that reaches the target are kept and filled to k (surplus committed groups). On an
    engine with a large fixed cost per call (a CPU HF engine on short completions), a number that makes the first
    round fill its batch (engine batch / groups per step) gives fewer, fuller rounds and more surplus, which the
    trainer banks for the next step (``examples/configs/smollm2_learn.yaml`` sets it; docs/results.md measures what it
    buys)."""

    @field_validator("oversample")
    @classmethod
    def _check_oversample(cls, v: float | str) -> float | str:
        if v != "auto" and not 1.0 <= float(v) <= 64.0:
            raise ValueError("oversample must be 'auto' or a number in [1, 64]")
        return v


class MakesCommitPaths(Protocol):
    """``SequentialAllocator.commit_paths``: ``CommitPaths`` itself, or e.g. a ``functools.partial`` of it."""

    def __call__(self) -> CommitPaths: ...


class SequentialAllocator(BudgetAllocator):
    """Template for sequential stopping rules (see the module docstring): override ``decide`` (and optionally
    ``drain``)."""

    name = "sequential"
    Config: ClassVar[type[SequentialConfig]] = SequentialConfig
    config: SequentialConfig
    model: EffectivenessModel = BinaryEffectiveness()
    commit_paths: ClassVar[MakesCommitPaths] = CommitPaths
    """Builds the P(commit) estimator behind ``oversample='auto'``. Its constants (``CommitPaths``' ``hist_units``,
    ``tail``, ``decay``) are fixed on purpose, not config fields: they only size admission (how many units are in flight,
    hence surplus and rounds per step), never a commit / abandon decision, and the defaults held on every population we
    measured. A subclass that wants others sets e.g. ``commit_paths = functools.partial(CommitPaths, tail=0.3)``."""

    def __init__(self, config: SequentialConfig | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 **overrides: object) -> None:
        super().__init__(config, **overrides)
        inner = self.config.internals
        self.prior: Prior = prior if prior is not None else ConstantPrior(inner.alpha0, inner.beta0)
        self._paths = self.commit_paths()  # P(commit) of fresh and in-flight units, sizes oversample='auto'

    @property
    def reward_range(self) -> tuple[float, float]:
        """The effectiveness model's reward range (binary: [0, 1]; continuous: its bounds)."""
        return self.model.reward_range

    # The hooks ---------------------------------------------------------------------------------------------------
    def decide(self, units: UnitView) -> np.ndarray:
        """Decision codes ``[len(units.ids)]`` for undecided units whose prefix is not mixed. Default: continue."""
        return np.full(len(units.ids), Decision.CONTINUE, np.int8)

    def drain(self, units: UnitView) -> np.ndarray:
        """Once the target is covered: which probing units get all their remaining rollouts (``[len(units.ids)]``
        bool). Default: none (their rollouts are discarded at the step's end)."""
        return np.zeros(len(units.ids), bool)

    # Template -------------------------------------------------------------------------------------------------
    def _view(self, ids: np.ndarray) -> UnitView:
        u = self.units
        return UnitView(ids=ids, n=u.n[ids], s=u.rsum[ids], k=self.k, table=u, model=self.model)

    def prior_params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        return self.prior.params(pool_index)

    def probe_size(self, unit_ids: np.ndarray) -> np.ndarray:
        """Rollouts each probing unit gets in its current probe (its probe-schedule entry)."""
        sched = np.asarray(self.config.internals.probe, np.int64)
        return cast(np.ndarray, sched[np.minimum(self.units.probes[unit_ids], len(sched) - 1)])

    def demand(self) -> tuple[np.ndarray, np.ndarray]:
        """Filling units: the rest of their group; probing units: their probe, or, once the target is covered, all
        their remaining rollouts if ``drain`` selects them and none otherwise."""
        u, k = self.units, self.k
        fill = np.flatnonzero(u.status == UnitStatus.FILLING)
        probe = np.flatnonzero(u.status == UnitStatus.PROBING)
        if self.needed() == 0:
            probe = probe[np.asarray(self.drain(self._view(probe)), bool)] if len(probe) else probe
            want = k - u.n[probe]
        else:
            want = np.minimum(self.probe_size(probe), k - u.n[probe])
        return np.concatenate([fill, probe]), np.concatenate([k - u.n[fill], want])

    def wants_prompts(self, idle: int) -> int:
        if idle <= 0 or self.needed() == 0:
            return 0
        u = self.units
        probing = u.status == UnitStatus.PROBING
        factor = self.config.oversample
        if factor == "auto":
            # Admit enough fresh units that the expected commits of the units in flight and of the fresh ones cover
            # the groups still needed; P(commit) from the units' probing paths (``sara.allocators.admission``).
            p_fresh, q = self._paths.estimate(u, probing, self._won())
            want = max(0, math.ceil((self.needed() - float(q.sum())) / max(p_fresh, 1.0 / 16.0) - 1e-9))
        else:
            want = max(0, math.ceil(self.needed() * float(factor)) - int(probing.sum()))
        cap = self._affordable_units()
        return min(idle, want if cap is None else min(want, cap))

    def commit_fraction(self) -> float:
        """Estimated probability that a fresh unit ends committed (``sara.allocators.admission``)."""
        u = self.units
        return self._paths.estimate(u, u.status == UnitStatus.PROBING, self._won())[0]

    def _won(self) -> np.ndarray:
        st = self.units.status
        return cast(np.ndarray, (st == UnitStatus.COMMITTED) | (st == UnitStatus.FILLING))

    def observe(self, unit_ids: np.ndarray, rewards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        u, k, eps = self.units, self.k, self.config.internals.eps
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
            d = np.asarray(self.decide(self._view(rest)), np.int8)
            if d.shape != rest.shape:
                raise ValueError(f"{type(self).__name__}.decide returned shape {d.shape}, expected {rest.shape}")
            bad = ~np.isin(d, (Decision.CONTINUE, Decision.COMMIT, Decision.ABANDON))
            if bad.any():
                raise ValueError(f"{type(self).__name__}.decide may return CONTINUE, COMMIT or ABANDON, got {d[bad][:3]}")
            commit_now = np.concatenate([commit_now, rest[d == Decision.COMMIT]])
            ab = rest[d == Decision.ABANDON]
            closed.append(ab)
            decisions.append(self._close(ab, Decision.ABANDON))
        # Commit: fill to k, or keep as is (always when already complete).
        done = (u.n[commit_now] >= k) | (self.config.completion == "as_is")
        closed.append(commit_now[done])
        decisions.append(self._close(commit_now[done], Decision.COMMIT))
        u.status[commit_now[~done]] = UnitStatus.FILLING
        return np.concatenate(closed), np.concatenate(decisions).astype(np.int8)

    def end_step(self) -> tuple[np.ndarray, np.ndarray]:
        u = self.units
        # Learn from the step's paths before the units still probing are closed: they are censored, not failures
        # (counted as failures, they would lower the estimate, raise the admission, and with it the surplus).
        self._paths.end_step(u, u.status == UnitStatus.PROBING, self._won())
        # A committed group cut short (budget, end of a streaming step) is still a valid (smaller) group.
        filling = np.flatnonzero(u.status == UnitStatus.FILLING)
        d_fill = self._close(filling, Decision.COMMIT)
        probing = np.flatnonzero(u.status == UnitStatus.PROBING)
        d_probe = self._close(probing, Decision.DISCARD)
        self.prior.update(*self.observations(), self.step)  # carried units count in the step that closes them
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
