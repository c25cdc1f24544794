"""The sequential template: probe units in rounds, commit mixed ones, ask ONE hook (``decide``) about the rest.

Writing a new stopping rule: subclass ``SequentialAllocator`` and override ``decide``::

    class AbandonAfterM(SequentialAllocator):
        def decide(self, units):            # units: UnitView over the undecided, unmixed units
            return np.where(units.n >= 3, Decision.ABANDON, Decision.CONTINUE)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, field_validator

from sara.allocators.admission import CommitPaths, record_probe
from sara.allocators.base import (
    AllocatorConfig,
    BinaryEffectiveness,
    BudgetAllocator,
    ConstantPrior,
    EffectivenessModel,
    Prior,
)
from sara.allocators.streaming import StreamingMixin
from sara.allocators.units import UnitStatus, UnitView
from sara.types import Decision

__all__ = ["SequentialAllocator", "SequentialConfig"]


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


class SequentialAllocator(StreamingMixin, BudgetAllocator):
    """Template for sequential stopping rules: probe units in rounds, commit mixed ones, ask ``decide`` for the rest.

    Per round and unit: a mixed prefix is committed (and filled to k in ``complete`` mode); a prefix that reached k
    without mixing is a saturated group and is discarded; every other unit gets ``decide(units)``: ``CONTINUE``,
    ``COMMIT`` (stop probing, fill the group in one go) or ``ABANDON`` (free the rest of its budget).

    Streaming drivers (``sara.collect_stream``) use the template's per-rollout API instead of ``plan`` / ``observe``
    rounds: ``dispatch`` / ``finished`` / ``inflight`` / ``abort`` / ``wants_slots`` (``sara.allocators.streaming``).
    """

    name = "sequential"
    Config = SequentialConfig
    model: EffectivenessModel = BinaryEffectiveness()
    commit_paths: ClassVar[Callable[[], CommitPaths]] = CommitPaths
    """Builds the P(commit) estimator behind ``oversample='auto'``. Its constants (``CommitPaths``' ``hist_units``,
    ``tail``, ``decay``) are fixed on purpose, not config fields: they only size admission (how many units are in flight,
    hence surplus and rounds per step), never a commit / abandon decision, and the defaults held on every population we
    measured. A subclass that wants others sets e.g. ``commit_paths = functools.partial(CommitPaths, tail=0.3)``."""

    def __init__(self, config: SequentialConfig | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 **overrides: Any) -> None:
        super().__init__(config, **overrides)
        self.prior: Prior = prior if prior is not None else ConstantPrior(self.config.alpha0, self.config.beta0)
        self._paths = self.commit_paths()  # P(commit) of fresh and in-flight units, sizes oversample='auto'

    # The one hook ------------------------------------------------------------------------------------------------
    def decide(self, units: UnitView) -> np.ndarray:
        """Decision codes ``[len(units.ids)]`` for undecided units whose prefix is not mixed. Default: continue."""
        return np.full(len(units.ids), Decision.CONTINUE, np.int8)

    def drain(self, units: UnitView) -> np.ndarray:
        """Once the target is covered: which probing units get all their remaining rollouts in the step's last round
        (``[len(units.ids)]`` bool). Default: none (their rollouts are discarded at the step's end)."""
        return np.zeros(len(units.ids), bool)

    def _drained(self, probing: np.ndarray) -> np.ndarray:
        """``drain`` over the probing units ``probing`` (bool mask; empty in, empty out)."""
        if not len(probing):
            return np.zeros(0, bool)
        u = self.units
        view = UnitView(ids=probing, n=u.n[probing], s=u.rsum[probing], k=self.k,
                        p_eff=self.model.p_effective(u, probing, self.k), table=u)
        return np.asarray(self.drain(view), bool)

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
        sched = np.asarray(self.config.probe, np.int64)
        want = sched[np.minimum(u.probes[probing], len(sched) - 1)]
        if self._needed() == 0:
            # The groups being filled complete the target, and the step ends when they do. Units still probing
            # either get all their remaining rollouts in this last round (``drain``: complete groups, as DS would
            # generate them) or none (their rollouts so far are discarded at the step's end). Probing them one more
            # round would only yield partial groups that flatter rollouts per effective group.
            keep = self._drained(probing)
            probing, want = probing[keep], (k - u.n[probing])[keep]
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
