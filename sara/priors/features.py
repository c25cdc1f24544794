"""Groups of prompts learned from their features: ``sara:group_by=auto``.

A pool rarely says which of its prompts are alike, but every prompt carries something: metadata keys (a level, a
source, a size, a count of digits) and its own length. ``FeatureGroupedPrior`` turns each such feature into a
candidate split of the pool (``feature_splits``: a categorical key's values as they are, a numeric key or the prompt
length cut at quantiles) and keeps one ``GroupedGridPrior`` per candidate, plus one population ("none"), all fitted on
the same closed units. Which one the stopping rule reads is decided online, at zero extra rollouts, by prequential
likelihood: at each step's end the step's (n, s) counts are scored under every candidate's fit as it stood when the
step began (out of sample), the scores are summed with a decay, and the rule reads the best candidate once it beats
the one in use by ``margin`` nats. The sequence likelihood does not depend on when a unit was stopped, so the score is
valid under the rule's own optional stopping.

An uninformative feature cannot win for long: its groups' fits are shrunk toward the pooled one and predict no better,
so the rule stays on one population (never worse than ``group_by=none``, which is never worse than DS under the
fitted population). A feature that points "the wrong way" is as good as one that points the right way: a group's fit
is nonparametric. Revisited prompts are refined by per-prompt history on top (``prior=history`` or a predictive
sampler), as with any population prior.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from sara.priors.base import Reweight
from sara.priors.grid import GridOptions, GridPrior, grid_loglik
from sara.priors.grouped import GroupedGridPrior, GroupedStart, metadata_values, value_codes
from sara.types import Prompt
from sara.units import UnitTable

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["FeatureGroupedPrior", "FeatureStart", "feature_splits", "prompt_length", "quantile_bins",
           "MAX_CATEGORIES", "NUMERIC_BINS", "LENGTH", "EMBEDDING"]

MAX_CATEGORIES = 32
"""A key with at most this many distinct values is split by value; a numeric key with more is cut at quantiles;
any other key with more (ids, free text) is not a candidate."""
NUMERIC_BINS = 6
"""Quantile bins of a numeric key and of the prompt length."""
LENGTH = "<length>"
"""The candidate name of the prompt's length in characters."""
EMBEDDING = "<embedding>"
"""``group_by=<embedding>``: groups are bands of a success rate predicted from the policy's representation of each
prompt (``sara.priors.representation``)."""


class FeatureStart(GroupedStart, total=False):
    """``FeatureGroupedPrior.like``'s options (the fitting options come from the base)."""

    decay: float
    margin: float
POPULATION = "none"
"""The candidate name of one population (no split); a metadata key of that name is no candidate."""
SCAN_LIMIT = 2_000_000
"""Pools larger than this are not scanned (one population)."""


def prompt_length(p: Prompt) -> int:
    """A prompt's length in characters (a chat prompt: the sum of its messages' contents)."""
    if isinstance(p.prompt, str):
        return len(p.prompt)
    return sum(len(str(m.get("content", ""))) for m in p.prompt)


def quantile_bins(values: np.ndarray, bins: int) -> np.ndarray | None:
    """Quantile-bin labels of numeric ``values``; None when they take fewer than two bins."""
    edges = np.unique(np.quantile(values, np.linspace(0, 1, bins + 1)[1:-1]))
    labels = np.searchsorted(edges, values, side="right")
    return labels if len(np.unique(labels)) > 1 else None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def feature_splits(prompts: Sequence[Prompt], *, probes: int = 64) -> dict[str, np.ndarray]:
    """Candidate splits of the pool, ``{feature name: group index per pool index}``: every ``Prompt.metadata`` key
    with 2..``MAX_CATEGORIES`` distinct values (by value), numeric keys with more (``NUMERIC_BINS`` quantile bins),
    and the prompt length in characters (``LENGTH``, quantile bins). A prompt without a key gets its own group.
    Features with one value are no candidates. A pool whose first ``probes`` evenly spaced prompts carry neither
    metadata nor text (a lazy simulated pool), or one over ``SCAN_LIMIT`` prompts, is not scanned."""
    size = len(prompts)
    if size == 0:
        return {}
    at = np.unique(np.linspace(0, size - 1, min(probes, size)).astype(np.int64))
    if not any(prompts[int(i)].metadata or prompt_length(prompts[int(i)]) for i in at) or size > SCAN_LIMIT:
        return {}
    rows = [prompts[i] for i in range(size)]
    out: dict[str, np.ndarray] = {}
    for key in sorted({k for p in rows for k in p.metadata} - {POPULATION}):
        values = metadata_values(rows, key)
        distinct = len(set(values))
        if distinct < 2:
            continue
        if distinct <= MAX_CATEGORIES:
            out[key] = value_codes(values)
        elif all(_is_number(v) for v in values):
            labels = quantile_bins(np.asarray(values, np.float64), NUMERIC_BINS)
            if labels is not None:
                out[key] = labels
    lengths = quantile_bins(np.asarray([prompt_length(p) for p in rows], np.float64), NUMERIC_BINS)
    if lengths is not None:
        out[LENGTH] = lengths
    return out


class FeatureGroupedPrior(GridPrior):
    """A population prior split by whichever prompt feature predicts outcomes best (see the module docstring).

    Args:
        splits: ``{feature: labels [pool]}`` (``feature_splits``); the population ("none") is always a candidate.
        decay: Weight of a past step's score per step of age (lets the choice follow a moving policy).
        margin: Nats by which a candidate's score must beat the one in use before the rule switches to it.
        shrink: Pseudo-units of the pooled fit in each group's fit (``GroupedGridPrior``).
        **kwargs: ``GridPrior``'s options.
    """

    default_reweight: ClassVar[Reweight] = "none"
    """``sara:reweight`` when unset: the rule's composition (weighting back gives ``auto``'s saving back on the
    arithmetic pools of docs/results.md, "Allocation rules in training")."""

    def __init__(self, splits: Mapping[str, np.ndarray], *, decay: float = 0.9, margin: float = 3.0,
                 shrink: float = 16.0, **kwargs: Unpack[GridOptions]) -> None:
        super().__init__(**kwargs)
        self.names = [POPULATION, *splits]
        labels = [np.zeros(max((len(v) for v in splits.values()), default=0), np.int64), *splits.values()]
        self.candidates = [GroupedGridPrior(np.asarray(lab, np.int64), shrink=shrink, **kwargs) for lab in labels]
        self.decay, self.margin = float(decay), float(margin)
        self.scores = np.zeros(len(self.candidates))
        self.chosen = 0
        self._frozen = [c.group_weights().copy() for c in self.candidates]  # each fit as the running step began

    @classmethod
    def like(cls, base: GridPrior, splits: Mapping[str, np.ndarray], **kwargs: Unpack[FeatureStart]
             ) -> FeatureGroupedPrior:
        """A feature-grouped prior with ``base``'s options and starting weights."""
        out = cls(splits, fit=base.fit, window=base.window, min_units=base.min_units, refit_growth=base.refit_growth,
                  smoothing=base.smoothing, **kwargs)
        for c in out.candidates:
            c.init, c.weights = base.init.copy(), base.weights.copy()
            c.group_w = np.tile(c.weights, (c.n_groups, 1))
        out.init, out.weights = base.init.copy(), base.weights.copy()
        out._frozen = [c.group_weights().copy() for c in out.candidates]
        return out

    @property
    def active(self) -> GroupedGridPrior:
        """The candidate the rule reads."""
        return self.candidates[self.chosen]

    @property
    def feature(self) -> str:
        """The feature in use ("none": one population)."""
        return self.names[self.chosen]

    @property
    def labels(self) -> np.ndarray:
        """Group of every pool index under the feature in use."""
        return self.active.labels

    # ---- what the rule reads: the candidate in use -------------------------------------------------------------
    def unit_groups(self, pool_index: np.ndarray) -> np.ndarray:
        return self.active.unit_groups(pool_index)

    def group_weights(self) -> np.ndarray:
        return self.active.group_weights()

    def group_share(self) -> np.ndarray:
        return self.active.group_share()

    def mean_params(self) -> tuple[float, float]:
        return self.active.mean_params()

    def composition_weights(self, k: int) -> np.ndarray:
        return self.active.composition_weights(k)

    def refresh(self, table: UnitTable) -> bool:
        changed = self.active.refresh(table)
        self.weights = self.active.weights
        return changed

    # ---- learning and choosing -----------------------------------------------------------------------------------
    def step_loglik(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray) -> np.ndarray:
        """``[candidates]`` log-likelihood of one step's closed units under each candidate's fit from the step's
        start (the binomial coefficients, equal across candidates, left out)."""
        n = np.asarray(n, np.int64)
        keep = n > 0
        idx, n = np.asarray(pool_index, np.int64)[keep], n[keep]
        s = np.rint(np.asarray(rsum, np.float64)[keep])
        ll = grid_loglik(self.grid, s, n - s)  # [units, G]
        top = ll.max(1, keepdims=True)
        lik = np.exp(ll - top)
        out = np.empty(len(self.candidates))
        for i, (c, w) in enumerate(zip(self.candidates, self._frozen)):
            out[i] = float(np.sum(np.log(np.maximum((lik * w[c.unit_groups(idx)]).sum(1), 1e-300)) + top[:, 0]))
        return out

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        scores = self.decay * self.scores + self.step_loglik(pool_index, n, rsum)
        # Kept relative to the worst candidate: only differences choose, and a checkpoint holds no negative numbers.
        self.scores = scores - scores.min()
        for c in self.candidates:
            c.update(pool_index, n, rsum, step)
        self._frozen = [c.group_weights().copy() for c in self.candidates]
        best = int(np.argmax(self.scores))
        if self.scores[best] > self.scores[self.chosen] + self.margin:
            self.chosen = best
        self.weights = self.active.weights

    # ---- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # Candidates by name (a mapping, so a resumed trainer checks each one's structure against its own).
        return {"names": list(self.names), "scores": self.scores.tolist(), "chosen": self.chosen,
                "frozen": {n: w.tolist() for n, w in zip(self.names, self._frozen)},
                "candidates": {n: c.state_dict() for n, c in zip(self.names, self.candidates)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        if list(state["names"]) != self.names:
            raise ValueError(f"feature-grouped prior: checkpoint has features {list(state['names'])}, this pool "
                             f"{self.names}")
        scores = np.asarray(state["scores"], np.float64)
        if scores.shape != self.scores.shape:
            raise ValueError(f"feature-grouped prior: {scores.size} scores for {len(self.candidates)} candidates")
        chosen = int(state["chosen"])
        if not 0 <= chosen < len(self.candidates):
            raise ValueError(f"feature-grouped prior: chosen candidate {chosen} out of range")
        for name, c in zip(self.names, self.candidates):
            c.load_state_dict(state["candidates"][name])
        self.scores, self.chosen = scores.copy(), chosen
        self._frozen = [np.asarray(state["frozen"][n], np.float64).reshape(c.group_weights().shape).copy()
                        for n, c in zip(self.names, self.candidates)]
        self.weights = self.active.weights
