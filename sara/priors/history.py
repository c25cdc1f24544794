"""Per-prompt history with decay (MoPPS-style), on top of a population prior.

``HistoryPrior`` gives a prompt seen before its own discounted posterior: ``alpha = alpha_base + lambda^dt *
successes_seen``, ``beta = beta_base + lambda^dt * failures_seen``, where ``dt`` is the number of steps since the
evidence was gathered (decay per step, so stale evidence fades toward the population; ``decay="auto"``, the default,
picks lambda online from how well each candidate predicted the prompts that came back) and the base is a population
prior (empirical Bayes, a grid mixture, or a constant). A prompt that failed 8/8 last epoch starts with a small p_eff
and is abandoned after one rollout. ``BorrowedHistory`` reads another component's history (a predictive sampler's,
``HistorySource``) so that sampler and allocator share one posterior per prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final, Literal, Protocol, cast, runtime_checkable

import numpy as np
from pydantic import PlainValidator
from scipy.special import betaln

from sara.config import ConfigError
from sara.priors.base import Prior
from sara.priors.beta import EmpiricalBayesPrior
from sara.units import UnitTable

__all__ = ["AUTO_DECAYS", "DEFAULT_DECAY", "START_DECAY", "BorrowedHistory", "Decay", "HistoryPrior", "HistorySource"]

AUTO_DECAYS = (0.5, 0.7, 0.85, 0.95, 0.99)
"""Candidates of ``decay="auto"``."""

START_DECAY = 0.7
"""The candidate ``decay="auto"`` uses until the revisits have said which predicts them best."""

DEFAULT_DECAY: Final = "auto"
"""Default weight per step of a prompt's past evidence (the history prior's and the predictive sampler's ``decay``).
Two things pull against each other: evidence has to outlive the interval between two visits of a prompt (about 1/f
steps when a step draws a fraction f of the pool), and it has to fade as fast as the policy moves. No fixed value
serves both a slowly moving policy (0.95 wins: the tiny policy, the drifting simulator) and a fast-learning LLM (0.7
wins: SmolLM2 on a 150-prompt pool, where 7-step-old "mixed" evidence keeps prompts the policy has since solved), so
the default chooses among ``AUTO_DECAYS`` online by how well each predicts revisits. Measured: docs/beyond.md,
section 3."""


def _decay(value: Any) -> float | Literal["auto"]:
    if value == "auto":
        return "auto"
    try:
        out = float(value)
    except (TypeError, ValueError):
        out = float("nan")
    if not 0.0 < out <= 1.0:
        raise ValueError("must be a number in (0, 1] or 'auto'")
    return out


Decay = Annotated[float | Literal["auto"], PlainValidator(_decay)]
"""A per-step weight in (0, 1], or "auto": chosen online among ``AUTO_DECAYS`` (``HistoryPrior``)."""


class HistoryPrior(Prior):
    """Per-prompt discounted Beta posterior on top of a population prior (MoPPS-style decay per step).

    With ``decay="auto"`` the prior keeps each prompt's evidence under every candidate of ``AUTO_DECAYS`` and reads
    the one that predicts revisits best, at zero extra rollouts: at each step's end the step's (n, s) of every prompt
    seen before is scored under each candidate's Beta-Binomial posterior as it stood when the step began (out of
    sample; a sequence likelihood, so valid whatever rule stopped the prompt), the scores are summed with weight
    ``score_decay`` per step of age, and the prior switches once a candidate beats the one in use by ``margin`` nats.
    A fast-moving policy makes old evidence mispredict, so a short memory wins; a slow one, a long memory.

    Args:
        decay: lambda in (0, 1]: evidence from ``dt`` steps ago counts ``lambda**dt`` times (1 = never forget);
            "auto" (the default): chosen online as above, starting at ``START_DECAY``.
        base: Population prior for unseen prompts and the floor of every prompt's prior (default: empirical Bayes).
        max_evidence: Cap on a prompt's decayed pseudo-count (keeps a prompt revisitable after drift).
        score_decay: ``decay="auto"``: weight of a past step's score per step of age.
        margin: ``decay="auto"``: nats by which a candidate must beat the one in use before the prior switches.
    """

    def __init__(self, decay: Decay = DEFAULT_DECAY, base: Prior | None = None, *, max_evidence: float = 64.0,
                 score_decay: float = 0.9, margin: float = 3.0) -> None:
        try:
            checked = _decay(decay)
        except ValueError as err:
            raise ConfigError(f"HistoryPrior: field 'decay': {err} (got {decay!r})") from None
        self.decays = np.asarray(AUTO_DECAYS if checked == "auto" else [checked], np.float64)
        self.chosen = int(np.argmin(np.abs(self.decays - START_DECAY)))
        self.base: Prior = base if base is not None else EmpiricalBayesPrior()
        self.max_evidence = float(max_evidence)
        self.score_decay, self.margin = float(score_decay), float(margin)
        self.scores = np.zeros(len(self.decays))  # prequential log-likelihood of revisits per candidate
        width = len(self.decays)
        self.succ = np.zeros((0, width))  # decayed successes per pool index and candidate decay, as of last_step
        self.fail: np.ndarray = np.zeros((0, width))
        self.last_step = np.zeros(0, np.int64)
        self.step = 0  # the step the next params() are for

    @property
    def decay(self) -> float:
        """The decay in use."""
        return float(self.decays[self.chosen])

    def _grow(self, size: int) -> None:
        if size > len(self.succ):
            extra = np.zeros((size - len(self.succ), len(self.decays)))
            self.succ = np.concatenate([self.succ, extra])
            self.fail = np.concatenate([self.fail, extra])
            self.last_step = np.concatenate([self.last_step, np.zeros(len(extra), np.int64)])

    def _weights(self, idx: np.ndarray, step: int) -> np.ndarray:
        """``[len(idx), candidates]`` weight of each prompt's stored evidence at ``step``."""
        return cast(np.ndarray, self.decays[None, :] ** np.maximum(step - self.last_step[idx], 0)[:, None])

    def evidence(self, pool_index: np.ndarray, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Decayed (successes, failures) of each prompt as seen from ``step`` (default: the coming step)."""
        idx = np.asarray(pool_index, np.int64)
        self._grow(int(idx.max()) + 1 if len(idx) else 0)
        step = self.step if step is None else step
        w = self.decay ** np.maximum(step - self.last_step[idx], 0)
        return self.succ[idx, self.chosen] * w, self.fail[idx, self.chosen] * w

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

    def step_loglik(self, prompts: np.ndarray, cnt: np.ndarray, s: np.ndarray, step: int) -> np.ndarray:
        """``[candidates]`` log-likelihood of each prompt's step outcomes (``cnt`` rollouts, ``s`` successes, one
        entry per distinct prompt) under each candidate's posterior from the step's start (binomial coefficients,
        equal across candidates, left out). Prompts without history score alike under every candidate."""
        base = self.base.params(prompts)
        w = self._weights(prompts, step)
        a = base["alpha0"][:, None] + self.succ[prompts] * w
        b = base["beta0"][:, None] + self.fail[prompts] * w
        return cast(np.ndarray, (betaln(a + s[:, None], b + (cnt - s)[:, None]) - betaln(a, b)).sum(0))

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        idx = np.asarray(pool_index, np.int64)
        cnt = np.asarray(n, np.float64)
        s = np.rint(np.asarray(rsum, np.float64))
        keep = cnt > 0  # units without delivered rollouts (aborted, carried on) carry no evidence
        idx, cnt, s = idx[keep], cnt[keep], s[keep]
        if len(idx):
            self._grow(int(idx.max()) + 1)
            u, inv = np.unique(idx, return_inverse=True)
            if len(self.decays) > 1:
                scores = self.score_decay * self.scores + self.step_loglik(
                    u, np.bincount(inv, cnt, len(u)), np.bincount(inv, s, len(u)), step)
                self.scores = scores - scores.min()  # only differences choose
                best = int(np.argmax(self.scores))
                if self.scores[best] > self.scores[self.chosen] + self.margin:
                    self.chosen = best
            # Bring the touched prompts' evidence to `step`, then add this step's counts.
            w = self._weights(u, step)
            self.succ[u] *= w
            self.fail[u] *= w
            self.last_step[u] = step
            np.add.at(self.succ, idx, s[:, None])
            np.add.at(self.fail, idx, (cnt - s)[:, None])
            tot = self.succ[u] + self.fail[u]
            scale = np.minimum(1.0, self.max_evidence / np.maximum(tot, 1e-12))
            self.succ[u] *= scale
            self.fail[u] *= scale
        if isinstance(self.base, EmpiricalBayesPrior):
            # Fit the population to one (decayed) count pair per prompt: a prompt the sampler favours is not counted
            # once per visit, which would bias the population toward the favoured prompts.
            succ, fail = self.succ[:, self.chosen], self.fail[:, self.chosen]
            seen = succ + fail >= 1.0
            self.base.fit_counts(succ[seen] + fail[seen], succ[seen])
        else:
            self.base.update(pool_index, n, rsum, step)
        self.step = step + 1

    def state_dict(self) -> dict[str, Any]:
        return {"base": self.base.state_dict(), "succ": self.succ.copy(), "fail": self.fail.copy(),
                "last_step": self.last_step.copy(), "step": self.step, "decays": self.decays.tolist(),
                "scores": self.scores.copy(), "chosen": self.chosen}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if list(state.get("decays", [])) != self.decays.tolist():
            raise ValueError(f"history prior: checkpoint has decays {list(state.get('decays', []))}, this prior "
                             f"{self.decays.tolist()} (resume with the decay the run was started with)")
        succ = np.asarray(state["succ"], np.float64)
        if succ.ndim != 2 or succ.shape[1] != len(self.decays):
            raise ValueError(f"history prior: evidence of shape {succ.shape} for {len(self.decays)} decays")
        chosen = int(state["chosen"])
        if not 0 <= chosen < len(self.decays):
            raise ValueError(f"history prior: chosen decay {chosen} out of range")
        self.base.load_state_dict(state["base"])
        self.succ = succ.copy()
        self.fail = np.asarray(state["fail"], np.float64).reshape(succ.shape).copy()
        self.last_step = np.asarray(state["last_step"], np.int64).copy()
        self.step = int(state["step"])
        self.scores = np.asarray(state["scores"], np.float64).reshape(len(self.decays)).copy()
        self.chosen = chosen


class BorrowedHistory(Prior):
    """Per-prompt priors read from another component's ``HistoryPrior`` (a predictive sampler's posterior).

    ``params`` = the base population prior plus the history's decayed evidence (``hist_s`` / ``hist_f``), like
    ``HistoryPrior``; ``update`` only teaches the base (the owner of the history updates it), and ``state_dict`` holds
    only the base (the owner checkpoints the history). Built by ``sara.build.build_allocation``.

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
