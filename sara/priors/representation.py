"""Difficulty learned online from the policy's own representation of each prompt: ``sara:group_by=<embedding>``.

The backend's prefill gives every prompt of the pool a vector (``sara.envs.base.EmbedsPrompts``: the mean final
hidden state over the prompt's own tokens, computed once at the start; no rollout spent). ``RepresentationPrior``
learns which direction of it predicts outcomes: at each step's end it regresses every closed prompt's posterior mean
success rate (under the pooled fit, so a prefix cut after one failure counts for what it says whatever the rule's
stopping) on the representation's top principal components (ridge, standardized), predicts the success rate of
every prompt of the pool, drawn or not, and cuts the pool into ``bands`` quantile bands of the prediction: one grid
mixture per band (``GroupedGridPrior``, each shrunk toward the pooled fit), refitted on the window's units under the
new bands. The pool stays one band until the fit has predicted a step's outcomes out of sample better than the
window's mean outcome (a decayed score, as the learned split's), so a representation that predicts nothing leaves one
population.
Clusters of the same vectors would follow what varies most in them (which tokens a prompt holds), not what predicts
success; the regression looks for the latter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from sara.priors.base import Reweight
from sara.priors.features import NUMERIC_BINS, quantile_bins
from sara.priors.grid import GridPrior, grid_posterior
from sara.priors.grouped import GroupedGridPrior, GroupedOptions, GroupedStart

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["RepresentationPrior", "RepresentationStart", "principal_components"]


class RepresentationStart(GroupedStart, total=False):
    """``RepresentationPrior.like``'s options (the fitting options come from the base)."""

    bands: int
    dims: int
    ridge: float


def principal_components(x: np.ndarray, dims: int, *, sample: int = 4096, seed: int = 0,
                         chunk: int = 8192) -> np.ndarray:
    """``[rows, d]`` the rows of ``x [rows, D]`` on their top ``d <= dims`` principal components, each scaled to unit
    variance (components without variance dropped; fitted on at most ``sample`` rows drawn with ``seed``). A larger
    pool is centred and projected ``chunk`` rows at a time, so no float64 copy of the whole of ``x`` is made (``x``
    itself is ``rows x D x 4`` bytes in float32)."""
    x = np.asarray(x)
    if x.ndim != 2 or not len(x):
        return np.zeros((len(x), 0))
    whole = len(x) <= sample  # the fit sees every row, already centred: project them as they are
    if whole:
        fit = np.asarray(x, np.float64)
        fit = fit - fit.mean(0)
    else:
        mean = x.mean(0, dtype=np.float64)
        rows = np.sort(np.random.default_rng(seed).choice(len(x), sample, replace=False))
        fit = np.asarray(x[rows], np.float64) - mean
    _, sv, vt = np.linalg.svd(fit, full_matrices=False)
    d = int(min(dims, np.sum(sv > (sv[0] * 1e-6 if len(sv) else np.inf))))
    z = fit @ vt[:d].T if whole else np.concatenate(
        [(np.asarray(x[i:i + chunk], np.float64) - mean) @ vt[:d].T for i in range(0, len(x), chunk)])
    return cast(np.ndarray, z / np.maximum(z.std(0), 1e-12))


class RepresentationPrior(GroupedGridPrior):
    """A grouped grid prior whose groups are bands of a success rate predicted from each prompt's representation
    (see the module docstring).

    Args:
        features: ``[pool, D]`` the representation of every pool index.
        bands: Quantile bands of the predicted success rate (the groups).
        dims: Principal components of the representation the regression reads.
        ridge: Ridge penalty on the standardized components (the intercept is free).
        **kwargs: ``GroupedGridPrior``'s options (``shrink``, ``fit``, ``window``, ``min_units``, ...).
    """

    fixed_labels: ClassVar[bool] = False
    default_reweight: ClassVar[Reweight] = "ds"
    """Bands of what mixes cheaply now: the rule abandons the low bands early, so the batch is weighted back to DS's
    composition over them by default, lest a band the policy is about to learn be starved (docs/allocation.md)."""

    def __init__(self, features: np.ndarray, *, bands: int = NUMERIC_BINS, dims: int = 32, ridge: float = 10.0,
                 **kwargs: Unpack[GroupedOptions]) -> None:
        feats = np.asarray(features)  # principal_components makes the float64 copies it needs
        super().__init__(np.zeros(len(feats), np.int64), [f"band{i}" for i in range(bands)], **kwargs)
        self.n_groups = int(bands)
        self.group_w = np.tile(self.weights, (self.n_groups, 1))
        self.share = np.full(self.n_groups, 1.0 / self.n_groups)
        z = principal_components(feats, dims)
        self.z = np.concatenate([z, np.ones((len(z), 1))], 1)  # [pool, d + 1], the last column the intercept
        self.ridge = float(ridge)
        self.coef = np.zeros(self.z.shape[1])
        self.mean, self.fitted = 0.0, False  # the window's mean outcome beside the fit; whether there is a fit
        self.decay = 0.9
        self.gain = 0.0  # decayed out-of-sample squared error the fit saved against the mean (bands while > 0)
        self._phist: list[np.ndarray] = []  # per past step: pool index of every unit with data (aligned with _hist)

    @classmethod
    def like(cls, base: GridPrior, features: np.ndarray,  # type: ignore[override]
             **kwargs: Unpack[RepresentationStart]) -> RepresentationPrior:
        """A representation prior with ``base``'s options and starting weights."""
        out = cls(features, fit=base.fit, window=base.window, min_units=base.min_units,
                  refit_growth=base.refit_growth, smoothing=base.smoothing, **kwargs)
        out.init, out.weights = base.init.copy(), base.weights.copy()
        out.group_w = np.tile(out.weights, (out.n_groups, 1))
        return out

    def predict(self, pool_index: np.ndarray | None = None) -> np.ndarray:
        """Predicted success rate of each pool index (all of them by default), clipped to [0, 1]."""
        z = self.z if pool_index is None else self.z[np.asarray(pool_index, np.int64)]
        return cast(np.ndarray, np.clip(z @ self.coef, 0.0, 1.0))

    def _relabel(self, pool_index: np.ndarray, ns: np.ndarray, new: int) -> None:
        """Score the last fit on the step's ``new`` units (the last rows), refit the regression on the window's units,
        and cut the pool into bands of its prediction while the fit predicts better than the mean."""
        if not self.fit or len(ns) < self.min_units or self.z.shape[1] < 2:
            return
        y = grid_posterior(self.weights, self.grid, ns[:, 1], ns[:, 0] - ns[:, 1]) @ self.grid
        z = self.z[pool_index]
        if self.fitted:  # out of sample: the fit from before this step against the mean it was fitted beside
            y_new, z_new = y[len(y) - new:], z[len(z) - new:]
            err = np.clip(z_new @ self.coef, 0.0, 1.0) - y_new
            self.gain = self.decay * self.gain + float(np.sum((self.mean - y_new) ** 2) - np.sum(err**2))
        penalty = np.full(z.shape[1], self.ridge)
        penalty[-1] = 0.0
        self.coef = np.linalg.solve(z.T @ z + np.diag(penalty), z.T @ y)
        self.mean, self.fitted = float(y.mean()), True
        labels = quantile_bins(self.z @ self.coef, self.n_groups) if self.gain > 0 else None
        self.labels = np.zeros(len(self.z), np.int64) if labels is None else labels.astype(np.int64)

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        n = np.asarray(n, np.int64)
        keep = n > 0
        idx = np.asarray(pool_index, np.int64)[keep]
        ns = np.stack([n[keep], np.rint(np.asarray(rsum, np.float64)[keep])], 1).astype(np.int64)
        self._phist.append(idx)
        del self._phist[: -self.window]
        past = len(self._phist) - 1  # the past steps still in the window: the last `past` entries of _hist
        window_ns = np.concatenate([*(self._hist[-past:] if past else []), ns])
        self._relabel(np.concatenate(self._phist), window_ns, len(ns))
        # The past steps' groups under the new bands (GroupedGridPrior.update appends this step's and refits).
        self._ghist = [self.unit_groups(p) for p in self._phist[:-1]]
        super().update(pool_index, n, rsum, step)

    def state_dict(self) -> dict[str, Any]:
        # Signed numbers as (positive part, negative part): a checkpoint holds no negative numbers.
        coef = [np.maximum(self.coef, 0).tolist(), np.maximum(-self.coef, 0).tolist()]
        return {**super().state_dict(), "coef": coef,
                "labels": self.labels.tolist(), "phist": [p.tolist() for p in self._phist], "mean": self.mean,
                "fitted": self.fitted, "gain": [max(self.gain, 0.0), max(-self.gain, 0.0)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        super().load_state_dict(state)
        if "coef" in state:
            pos, neg = (np.asarray(c, np.float64) for c in state["coef"])
            coef, labels = pos - neg, np.asarray(state["labels"], np.int64)
            if coef.shape != self.coef.shape or labels.shape != self.labels.shape:
                raise ValueError(f"representation prior: checkpoint has {coef.size - 1} components and "
                                 f"{labels.size} prompts, this run {self.coef.size - 1} and {self.labels.size}")
            if labels.size and (labels.min() < 0 or labels.max() >= self.n_groups):
                raise ValueError(f"representation prior: checkpoint bands out of range 0..{self.n_groups - 1}")
            self.coef, self.labels = coef.copy(), labels.copy()
            self.mean, self.fitted = float(state["mean"]), bool(state["fitted"])
            self.gain = float(state["gain"][0]) - float(state["gain"][1])
            self._phist = [np.asarray(p, np.int64).copy() for p in state["phist"]]
