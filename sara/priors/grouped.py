"""A population prior per group of prompts: ``sara:group_by=KEY`` (one grid mixture per value of a prompt feature;
``sara``'s default ``group_by=component|<embedding>`` splits a ``sara/Mixture-v0`` pool by component).

A pool is rarely one population. Mixture components, MATH levels or Countdown sizes each have their own spread of
success rates, and a single pooled prior blurs them: on the default pool (1- to 4-digit sums) a first failure says
little about a prompt when 3-digit prompts (p ~ 0.1, often mixed) and 4-digit ones (p ~ 0, almost never mixed) share
one prior, so the pooled optimal rule waits for a second failure on both. Fitted per group, the rule abandons a
4-digit prompt after one failure and never abandons a 2-digit one (docs/results.md, "Allocation rules in training", measures what that saves).

``GroupedGridPrior`` keeps, next to the pooled ``GridPrior`` fit, one grid mixture per group, each fitted by EM to
its own units' (n, s) counts with the pooled weights as a Dirichlet prior of ``shrink`` pseudo-units: a group with
little data stays at the pooled fit. One ``rho`` (rollouts per effective group) prices every group: it is the optimum
of the whole population, each group stopped by its own table, groups weighted by how many of their units the
sampler drew (Dinkelbach over the sum). Units are mapped to groups by pool index (``labels``), which
``sara.build.build_allocation`` derives from ``Prompt.metadata[group_by]``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from sara.config import ConfigError
from sara.priors.base import Prior, Reweight, population_of
from sara.priors.grid import GridOptions, GridPrior, GridStart, em_weights
from sara.types import Prompt
from sara.units import UnitTable

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["GroupedGridPrior", "GroupedOptions", "GroupedStart", "group_labels", "metadata_values",
           "prompt_groups", "value_codes", "MAX_GROUPS"]

MAX_GROUPS = 256
"""More distinct values than this is a ConfigError: a per-group fit needs data per group."""


class GroupedStart(GridStart, total=False):
    """``GroupedGridPrior.like``'s options (the fitting options come from the base)."""

    shrink: float


class GroupedOptions(GridOptions, total=False):
    """``GroupedGridPrior``'s options after the labels and names, as the priors built on it pass them on."""

    shrink: float


def group_labels(prompts: Sequence[Prompt], key: str) -> tuple[np.ndarray, list[Hashable]]:
    """``(labels [pool], names)``: each prompt's group index by ``Prompt.metadata[key]`` (missing: its own group).

    Raises:
        ConfigError: naming ``group_by`` when no prompt has ``key`` or when it has more than ``MAX_GROUPS`` values.
    """
    values = metadata_values(prompts, key)
    if prompts and all(v is None for v in values):
        keys = sorted({k for p in prompts for k in p.metadata})
        raise ConfigError(f"sara: field 'group_by': no prompt has metadata key {key!r}; keys present: "
                          f"{', '.join(keys) or '(none)'}; pick one of them or drop group_by")
    names = list(dict.fromkeys(values))
    if len(names) > MAX_GROUPS:
        raise ConfigError(f"sara: field 'group_by': metadata key {key!r} has {len(names)} distinct values (at most "
                          f"{MAX_GROUPS}); group by a coarser feature")
    return value_codes(values, names), names


def metadata_values(prompts: Sequence[Prompt], key: str) -> list[Hashable]:
    """``Prompt.metadata[key]`` of every prompt, hashable (lists as tuples, dicts as sorted pairs; missing: None)."""
    return [_hashable(p.metadata.get(key)) for p in prompts]


def value_codes(values: Sequence[Hashable], names: Sequence[Hashable] | None = None) -> np.ndarray:
    """The index of each value in ``names`` (default: the distinct values in order of first appearance)."""
    index = {v: i for i, v in enumerate(dict.fromkeys(values) if names is None else names)}
    return np.asarray([index[v] for v in values], np.int64)


def prompt_groups(prior: Prior | None) -> np.ndarray | None:
    """The group of every pool index when ``prior`` is split by groups (``GroupedGridPrior``, directly or as the base
    of a history prior) and the groups stay fixed, else None: what a run's 'DS would have spent' estimate should fit
    per group."""
    population = None if prior is None else population_of(prior)
    if isinstance(population, GroupedGridPrior) and population.fixed_labels:
        return population.labels
    return None


def _hashable(v: object) -> Hashable:
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


class GroupedGridPrior(GridPrior):
    """``GridPrior`` with one mixture per group of prompts and one ``rho`` across them.

    Args:
        labels: Group index of every pool index (``group_labels``); pool indices beyond it fall in group 0.
        names: The groups' names (reports only).
        shrink: Pseudo-units of the pooled fit in each group's fit.
        **kwargs: ``GridPrior``'s options (``alpha0``, ``beta0``, ``fit``, ``window``, ``min_units``, ...).
    """

    fixed_labels: ClassVar[bool] = True
    """Whether ``labels`` stay as given (False: a subclass moves prompts between groups as it learns)."""
    default_reweight: ClassVar[Reweight] = "none"
    """``sara:reweight`` when unset: groups given by the pool keep the rule's composition (``SARAConfig.reweight``)."""

    def __init__(self, labels: np.ndarray, names: Sequence[Hashable] = (), *, shrink: float = 16.0,
                 **kwargs: Unpack[GridOptions]) -> None:
        super().__init__(**kwargs)
        self.labels = np.asarray(labels, np.int64)
        self.n_groups = int(self.labels.max()) + 1 if len(self.labels) else 1
        self.names = list(names) or list(range(self.n_groups))
        self.shrink = float(shrink)
        self.group_w = np.tile(self.weights, (self.n_groups, 1))
        self.share = np.full(self.n_groups, 1.0 / self.n_groups)  # share of drawn units per group
        self._ghist: list[np.ndarray] = []  # per past step: group of every unit with data (aligned with _hist)

    @classmethod
    def like(cls, base: GridPrior, labels: np.ndarray, names: Sequence[Hashable] = (),
             **kwargs: Unpack[GroupedStart]) -> GroupedGridPrior:
        """A grouped prior with ``base``'s options and starting weights."""
        out = cls(labels, names, fit=base.fit, window=base.window, min_units=base.min_units,
                  refit_growth=base.refit_growth, smoothing=base.smoothing, **kwargs)
        out.init, out.weights = base.init.copy(), base.weights.copy()
        out.group_w = np.tile(out.weights, (out.n_groups, 1))
        return out

    # ---- groups ------------------------------------------------------------------------------------------------
    def unit_groups(self, pool_index: np.ndarray) -> np.ndarray:
        """Group index of each pool index."""
        idx = np.asarray(pool_index, np.int64)
        out = np.zeros(len(idx), np.int64)
        inside = idx < len(self.labels)
        out[inside] = self.labels[idx[inside]]
        return out

    def group_weights(self) -> np.ndarray:
        """``[groups, G]`` grid weights of every group."""
        return self.group_w

    def group_share(self) -> np.ndarray:
        """``[groups]`` share of the units drawn from each group (add-one smoothed) in the fitted window."""
        return self.share

    def composition_weights(self, k: int) -> np.ndarray:
        """``[groups]`` how many committed groups DS would get from a group per one the rule got, up to a common factor.

        DS commits a drawn unit of group g when its k rollouts mix: P = E[1 - p^k - (1-p)^k] under the group's fit. The
        rule commits the share of g's drawn units in the fitted window that ended mixed (add-one smoothed), which is
        lower where it abandons more. Their ratio, used as a weight on each committed group's advantages, gives the
        batch DS's expected composition over the groups (``SARAConfig.reweight``): a group the rule abandons early is
        not starved of gradient.
        """
        ns, groups = self._data(None), self._groups_of(None)
        mixed = (ns[:, 1] > 0) & (ns[:, 1] < ns[:, 0])
        drawn = np.bincount(groups, minlength=self.n_groups).astype(np.float64)
        won = np.bincount(groups[mixed], minlength=self.n_groups).astype(np.float64)
        ds = self.group_w @ (1.0 - self.grid**k - (1.0 - self.grid) ** k)
        return ds / ((won + 1.0) / (drawn + 2.0))

    # ---- fitting -----------------------------------------------------------------------------------------------
    def _refit(self, table: UnitTable | None) -> bool:
        """The pooled fit (each group's shrinkage target), then one EM per group; True when the groups changed."""
        ns, groups = self._data(table), self._groups_of(table)
        self._em(ns)
        if not self.fit or len(ns) < self.min_units:
            return False
        prior = self.shrink * self.weights + self.smoothing / len(self.grid)
        self.group_w = np.stack([em_weights(self.grid, ns[groups == g], self.group_w[g], prior)
                                 for g in range(self.n_groups)])
        counts = np.bincount(groups, minlength=self.n_groups).astype(np.float64)
        self.share = (counts + 1.0) / (counts.sum() + self.n_groups)
        return True

    def _groups_of(self, table: UnitTable | None) -> np.ndarray:
        parts = list(self._ghist)
        if table is not None:
            parts.append(self.unit_groups(table.pool_index[table.n > 0]))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        keep = np.asarray(n) > 0
        self._ghist.append(self.unit_groups(np.asarray(pool_index, np.int64)[keep]))  # aligned with GridPrior's _hist
        del self._ghist[: -self.window]
        super().update(pool_index, n, rsum, step)

    # ---- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "group_w": self.group_w.tolist(), "share": self.share.tolist(),
                "ghist": [h.tolist() for h in self._ghist]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not state:
            return
        super().load_state_dict(state)
        if "group_w" in state:
            gw = np.asarray(state["group_w"], np.float64)
            if gw.shape != self.group_w.shape:
                raise ValueError(f"grouped prior: checkpoint has {gw.shape[0]} groups, this pool {self.n_groups}")
            share = np.asarray(state["share"], np.float64)
            if share.shape != self.share.shape:
                raise ValueError(f"grouped prior: checkpoint has {share.size} group shares, this pool {self.n_groups}")
            self.group_w, self.share = gw.copy(), share.copy()
            self._ghist = [np.asarray(h, np.int64).copy() for h in state["ghist"]]
