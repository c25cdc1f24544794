"""How many fresh prompts to admit: the empirical probability that a unit ends committed, given its probing path.

``SequentialAllocator`` with ``oversample="auto"`` keeps enough units in flight that their expected commits cover the
groups still needed. That needs P(commit) of a fresh unit and of each unit still probing, and the obvious estimate,
the committed share of the units decided so far, is badly biased: decisions arrive at different depths. A rule that
abandons after one identical outcome (SARA with a learned, lopsided prior) decides most units after their first
rollout, while a commit needs a mixed prefix (two rollouts or more), so after the first round the decided units are
all abandoned ones, the share is ~0, and the allocator would admit 16x what it needs (the 1/16 floor), committing far
more than the target per step. Counting the units still probing at the end of a step as failures would carry the bias
into the next steps. And the survivors of such a rule are the units whose first outcome was the minority one, several
times likelier to commit than a fresh unit, so counting each in-flight unit as one fresh unit over-admits as well.

``CommitPaths`` estimates instead, nonparametrically, the chain a unit walks through: after each probing round an
unmixed unit sits in state ``(j, side)`` (j rounds, all outcomes identical, on the failing or the succeeding side),
where the rule decides it (abandon / commit / saturated discard) or lets it continue, and the next probe mixes it
(commit) or moves it to ``(j + 1, side)``. Per state it counts units entered, decided, committed by decision, probed
again, and mixed by that probe; units still probing are censored (they count as entered and continuing, and nothing
is assumed about their fate). Backward over j::

    q_cont(j, o)  = m + (1 - m) q_enter(j + 1, o)           m = mixed / probed again, from (j, o)
    q_enter(j, o) = committed_by_decision / entered + (1 - decided / entered) q_cont(j, o)
    q_fresh       = mixed in round 1 / probed + sum_o P(first round ends on side o) q_enter(1, o)

The running step's counts are pooled with an EMA of earlier steps' (normalized per unit probed, worth ``hist_units``
units), so states the step has not reached yet use earlier steps' frequencies while the ones it has reached follow the
running step (a prior refitted within the step can change the rule at depth 1 from one step to the next). Conditioning
on the side keeps earlier steps' frequencies valid across such a change: which states the rule abandons moves, what
happens to a unit that continues from a state does not. A state with no data at all gets ``tail``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sara.units import UnitTable

__all__ = ["CommitPaths", "record_probe"]

# Per-unit path columns in ``UnitTable.extra``.
SIDE = "side"  # 0: no identical prefix yet (or mixed by its first probe); 1: identical failures; 2: identical successes
MIXED_AT = "mixed_at"  # probing round in which the prefix became mixed (0: never)

# Count arrays [5, 3 sides, depth]: entered, decided (while unmixed), committed by decision, probed again, mixed.
ENTER, DEC, DCOM, NEXT, MIX = range(5)


def _column(table: UnitTable, key: str) -> np.ndarray:
    col = table.extra.get(key)
    if col is None:
        col = table.extra[key] = np.zeros(len(table), np.int64)
    return col


def record_probe(table: UnitTable, probed: np.ndarray, mixed: np.ndarray) -> None:
    """After a probing round: ``probed`` unit ids (their ``probes`` already counted), ``mixed`` their prefixes' state.

    The side of an identical prefix is that of its value (``>= 0.5``: the succeeding side; exact for binary rewards,
    and for others only a coarser stratification: the estimate stays consistent, it conditions on less).
    """
    side, mixed_at = _column(table, SIDE), _column(table, MIXED_AT)
    probed = np.asarray(probed, np.int64)
    mixed = np.asarray(mixed, bool)
    now_mixed = probed[mixed]
    mixed_at[now_mixed] = table.probes[now_mixed]
    same = probed[~mixed]
    side[same] = np.where(table.rmax[same] >= 0.5, 2, 1)


class CommitPaths:
    """Empirical P(commit) of fresh and in-flight units from their probing paths; see the module docstring.

    Args:
        hist_units: Weight, in units, of earlier steps' (normalized) counts against the running step's.
        tail: P(commit) assumed for a state nothing has been seen in yet.
        decay: EMA weight of the older history at each finished step.
    """

    def __init__(self, hist_units: float = 8.0, tail: float = 0.5, decay: float = 0.5) -> None:
        self.hist_units = float(hist_units)
        self.tail = float(tail)
        self.decay = float(decay)
        self.hist = np.zeros((5, 3, 1))

    # ---- counting --------------------------------------------------------------------------------------------------
    @staticmethod
    def counts(table: UnitTable, probing: np.ndarray, won: np.ndarray) -> np.ndarray:
        """``[5, 3, depth]`` counts of one step's units; ``probing`` / ``won``: bool per unit, still probing /
        committed (or committed and filling)."""
        probes = np.asarray(table.probes, np.int64)
        seen = probes >= 1
        side = _column(table, SIDE)[seen]
        mixed_at = _column(table, MIXED_AT)[seen]
        probing = np.asarray(probing, bool)[seen]
        won = np.asarray(won, bool)[seen]
        p = probes[seen]
        mixed = mixed_at > 0
        depth = np.where(mixed, p - 1, p)  # rounds spent unmixed
        size = int(p.max(initial=0)) + 2
        out = np.zeros((5, 3, size))
        decided = ~mixed & ~probing
        np.add.at(out[DEC], (side[decided], depth[decided]), 1.0)
        np.add.at(out[DCOM], (side[decided & won], depth[decided & won]), 1.0)
        np.add.at(out[MIX], (side[mixed], depth[mixed]), 1.0)
        # entered (j, o) for every j <= depth: a reversed cumulative count of depths; fresh state = every unit probed
        reach = np.zeros((3, size))
        np.add.at(reach, (side, depth), 1.0)
        out[ENTER] = np.cumsum(reach[:, ::-1], axis=1)[:, ::-1]
        out[ENTER, :, 0] = 0.0
        out[ENTER, 0, 0] = float(len(p))
        # probed again from (j, o): mixed by the next probe, or went on to depth j + 1
        out[NEXT] = out[MIX]
        out[NEXT, :, :-1] += out[ENTER, :, 1:]
        out[NEXT, :, 0] = 0.0
        out[NEXT, 0, 0] = float(len(p))
        return out

    def _pooled(self, current: np.ndarray) -> np.ndarray:
        size = max(current.shape[2], self.hist.shape[2])

        def pad(a: np.ndarray) -> np.ndarray:
            return np.pad(a, ((0, 0), (0, 0), (0, size - a.shape[2])))

        return pad(current) + self.hist_units * pad(self.hist)

    # ---- estimates ---------------------------------------------------------------------------------------------
    def _solve(self, c: np.ndarray) -> tuple[float, np.ndarray]:
        """``(q_fresh, q_cont[3, depth])`` from pooled counts."""
        size = c.shape[2]
        tail = self.tail
        q_cont = np.full((3, size), tail)
        q_enter = np.full((3, size + 1), tail)
        for j in range(size - 1, 0, -1):
            for o in (1, 2):
                nxt = c[NEXT, o, j]
                if nxt > 0:
                    m = c[MIX, o, j] / nxt
                    q_cont[o, j] = m + (1.0 - m) * q_enter[o, j + 1]
                e = c[ENTER, o, j]
                if e > 0:
                    q_enter[o, j] = c[DCOM, o, j] / e + max(0.0, 1.0 - c[DEC, o, j] / e) * q_cont[o, j]
        e0 = c[ENTER, 0, 0]
        if e0 <= 0:
            return tail, q_cont
        q_fresh = c[MIX, 0, 0] / e0 + sum(c[ENTER, o, 1] / e0 * q_enter[o, 1] for o in (1, 2))
        return float(np.clip(q_fresh, 0.0, 1.0)), np.clip(q_cont, 0.0, 1.0)

    def estimate(self, table: UnitTable, probing: np.ndarray, won: np.ndarray) -> tuple[float, np.ndarray]:
        """``(p_fresh, q)``: P(commit) of a fresh unit, and of each unit now probing (``q[i]`` for the i-th probing
        unit in id order, given its path so far); ``probing`` / ``won`` as in ``counts``."""
        p_fresh, q_cont = self._solve(self._pooled(self.counts(table, probing, won)))
        ids = np.flatnonzero(probing)
        p = np.asarray(table.probes, np.int64)[ids]
        side = _column(table, SIDE)[ids]
        q = np.where(p == 0, p_fresh, q_cont[side, np.minimum(p, q_cont.shape[1] - 1)])
        return p_fresh, q

    def fresh(self) -> float:
        """P(commit) of a fresh unit from the history alone (what the next step starts from)."""
        return self._solve(self.hist)[0] if self.hist[ENTER, 0, 0] > 0 else self.tail

    def end_step(self, table: UnitTable, probing: np.ndarray, won: np.ndarray) -> None:
        """Fold a finished step in (call before its open units are closed: they are censored, not failures)."""
        c = self.counts(table, probing, won)
        if c[ENTER, 0, 0] <= 0:
            return
        c = c / c[ENTER, 0, 0]
        if self.hist[ENTER, 0, 0] <= 0:
            self.hist = c
            return
        size = max(c.shape[2], self.hist.shape[2])

        def pad(a: np.ndarray) -> np.ndarray:
            return np.pad(a, ((0, 0), (0, 0), (0, size - a.shape[2])))

        self.hist = self.decay * pad(self.hist) + (1.0 - self.decay) * pad(c)

    # ---- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"hist": self.hist.tolist()}  # nested lists: states compare with ==

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        hist = np.asarray(state.get("hist", np.zeros((5, 3, 1))), np.float64)
        self.hist = hist.copy() if hist.ndim == 3 and hist.shape[:2] == (5, 3) else np.zeros((5, 3, 1))
