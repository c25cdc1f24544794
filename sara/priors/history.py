"""Per-prompt history with decay (MoPPS-style), on top of a population prior.

``HistoryPrior`` gives a prompt seen before its own discounted posterior: ``alpha = alpha_base + lambda^dt *
successes_seen``, ``beta = beta_base + lambda^dt * failures_seen``, where ``dt`` is the number of steps since the
evidence was gathered (decay per step, so stale evidence fades toward the population) and the base is a population
prior (empirical Bayes, a grid mixture, or a constant). A prompt that failed 8/8 last epoch starts with a small p_eff
and is abandoned after one rollout. ``BorrowedHistory`` reads another component's history (a predictive sampler's,
``HistorySource``) so that sampler and allocator share one posterior per prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from sara.config import ConfigError
from sara.priors.base import Prior
from sara.priors.beta import EmpiricalBayesPrior
from sara.units import UnitTable

__all__ = ["DEFAULT_DECAY", "BorrowedHistory", "HistoryPrior", "HistorySource"]

DEFAULT_DECAY = 0.7
"""Default weight per step of a prompt's past evidence (the history prior's and the predictive sampler's ``decay``).
Two things pull against each other: evidence has to outlive the interval between two visits of a prompt (about 1/f
steps when a step draws a fraction f of the pool), and it has to fade as fast as the policy moves. On a fast-learning
LLM the second wins: SmolLM2 on a 150-prompt pool spends fewer rollouts per effective group at 0.7 than at 0.95, whose
7-step-old "mixed" evidence keeps prompts the policy has since solved; on a slowly moving policy 0.95 wins (the tiny
policy, the drifting simulator). Measured: docs/beyond.md, section 3."""


class HistoryPrior(Prior):
    """Per-prompt discounted Beta posterior on top of a population prior (MoPPS-style decay per step).

    Args:
        decay: lambda in (0, 1]: evidence from ``dt`` steps ago counts ``lambda**dt`` times (1 = never forget).
        base: Population prior for unseen prompts and the floor of every prompt's prior (default: empirical Bayes).
        max_evidence: Cap on a prompt's decayed pseudo-count (keeps a prompt revisitable after drift).
    """

    def __init__(self, decay: float = DEFAULT_DECAY, base: Prior | None = None, *, max_evidence: float = 64.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ConfigError(f"HistoryPrior: field 'decay': must be in (0, 1] (got {decay})")
        self.decay = float(decay)
        self.base: Prior = base if base is not None else EmpiricalBayesPrior()
        self.max_evidence = float(max_evidence)
        self.succ = np.zeros(0)  # decayed successes per pool index, as of last_step
        self.fail = np.zeros(0)
        self.last_step = np.zeros(0, np.int64)
        self.step = 0  # the step the next params() are for

    def _grow(self, size: int) -> None:
        if size > len(self.succ):
            extra = size - len(self.succ)
            self.succ = np.concatenate([self.succ, np.zeros(extra)])
            self.fail = np.concatenate([self.fail, np.zeros(extra)])
            self.last_step = np.concatenate([self.last_step, np.zeros(extra, np.int64)])

    def evidence(self, pool_index: np.ndarray, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Decayed (successes, failures) of each prompt as seen from ``step`` (default: the coming step)."""
        idx = np.asarray(pool_index, np.int64)
        self._grow(int(idx.max()) + 1 if len(idx) else 0)
        step = self.step if step is None else step
        w = self.decay ** np.maximum(step - self.last_step[idx], 0)
        return self.succ[idx] * w, self.fail[idx] * w

    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        base = self.base.params(pool_index)
        s, f = self.evidence(pool_index)
        return {"alpha0": base["alpha0"] + s, "beta0": base["beta0"] + f, "hist_s": s, "hist_f": f}

    def refresh(self, table: UnitTable) -> bool:
        """Before any history exists, refit the base within the step (if it can) and rewrite the units' priors."""
        if self.succ.sum() + self.fail.sum() > 0 or not self.base.refresh(table):
            return False
        base = self.base.params(table.pool_index)
        hs = table.prior.get("hist_s", np.zeros(len(table)))
        hf = table.prior.get("hist_f", np.zeros(len(table)))
        table.prior["alpha0"] = base["alpha0"] + hs
        table.prior["beta0"] = base["beta0"] + hf
        return True

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        idx = np.asarray(pool_index, np.int64)
        cnt = np.asarray(n, np.float64)
        s = np.rint(np.asarray(rsum, np.float64))
        keep = cnt > 0  # units without delivered rollouts (aborted, carried on) carry no evidence
        idx, cnt, s = idx[keep], cnt[keep], s[keep]
        if len(idx):
            self._grow(int(idx.max()) + 1)
            u = np.unique(idx)
            # Bring the touched prompts' evidence to `step`, then add this step's counts.
            w = self.decay ** np.maximum(step - self.last_step[u], 0)
            self.succ[u] *= w
            self.fail[u] *= w
            self.last_step[u] = step
            np.add.at(self.succ, idx, s)
            np.add.at(self.fail, idx, cnt - s)
            tot = self.succ[u] + self.fail[u]
            scale = np.minimum(1.0, self.max_evidence / np.maximum(tot, 1e-12))
            self.succ[u] *= scale
            self.fail[u] *= scale
        if isinstance(self.base, EmpiricalBayesPrior):
            # Fit the population to one (decayed) count pair per prompt: a prompt the sampler favours is not counted
            # once per visit, which would bias the population toward the favoured prompts.
            seen = self.succ + self.fail >= 1.0
            self.base.fit_counts(self.succ[seen] + self.fail[seen], self.succ[seen])
        else:
            self.base.update(pool_index, n, rsum, step)
        self.step = step + 1

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base.state_dict(), "succ": self.succ.copy(), "fail": self.fail.copy(),
                "last_step": self.last_step.copy(), "step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        self.base.load_state_dict(state["base"])
        self.succ = np.asarray(state["succ"], np.float64).copy()
        self.fail = np.asarray(state["fail"], np.float64).copy()
        self.last_step = np.asarray(state["last_step"], np.int64).copy()
        self.step = int(state["step"])


class BorrowedHistory(Prior):
    """Per-prompt priors read from another component's ``HistoryPrior`` (a predictive sampler's posterior).

    ``params`` = the base population prior plus the history's decayed evidence (``hist_s`` / ``hist_f``), like
    ``HistoryPrior``; ``update`` only teaches the base (the owner of the history updates it), and ``state_dict`` holds
    only the base (the owner checkpoints the history). Built by ``sara.allocators.compose``.

    Args:
        history: The shared per-prompt history.
        base: Population prior for the evidence to sit on.
    """

    def __init__(self, history: HistoryPrior, base: Prior) -> None:
        self.history = history
        self.base = base

    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        base = self.base.params(pool_index)
        s, f = self.history.evidence(pool_index)
        return {"alpha0": base["alpha0"] + s, "beta0": base["beta0"] + f, "hist_s": s, "hist_f": f}

    def refresh(self, table: UnitTable) -> bool:
        """Refit the base within the step (when it can) and rewrite the units' priors."""
        if not self.base.refresh(table):
            return False
        base = self.base.params(table.pool_index)
        table.prior["alpha0"] = base["alpha0"] + table.prior.get("hist_s", np.zeros(len(table)))
        table.prior["beta0"] = base["beta0"] + table.prior.get("hist_f", np.zeros(len(table)))
        return True

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        self.base.update(pool_index, n, rsum, step)

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            self.base.load_state_dict(state["base"])


@runtime_checkable
class HistorySource(Protocol):
    """A component that keeps per-prompt posteriors it can lend (the predictive sampler's ``posterior``)."""

    posterior: HistoryPrior
