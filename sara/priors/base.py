"""The prior interface: how hard a prompt is before (and between) its rollouts, as per-unit Beta parameters.

A ``Prior`` gives each admitted unit its prior parameters (``params``: ``{"alpha0": [m], "beta0": [m]}``, plus
``hist_s`` / ``hist_f`` when it knows the prompt's own history), may refit within a running step (``refresh``), and
learns from every finished step (``update``). Allocators read it; samplers may own one (a predictive sampler's
per-prompt history) and lend it to an allocator (``sara.build.build_allocation``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from sara.units import UnitTable

__all__ = ["ConstantPrior", "GroupedPopulation", "Layered", "Prior", "Reweight", "population_of"]

Reweight = Literal["none", "ds"]
"""How a batch of groups is weighted (``SARAConfig.reweight``): 'ds' toward DS's composition over the groups, or not."""


class Prior(ABC):
    """Where a unit's prior comes from (constant, empirical Bayes, per-prompt history, a grid mixture, ...)."""

    @abstractmethod
    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        """Per-unit prior parameters, e.g. ``{"alpha0": [m], "beta0": [m]}``."""

    def refresh(self, table: UnitTable) -> bool:
        """Refit on the running step's units; True when the fit changed. A prior whose parameters live in
        ``table.prior`` (alpha0 / beta0) rewrites them in place; a grid prior's weights are read by the rule directly.
        Default: nothing to refit."""
        return False

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:  # noqa: B027
        """Learn from one finished step's observations (every unit, all decisions). Default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:  # noqa: B027
        """Restore what ``state_dict`` returned. Default: nothing to restore."""


class ConstantPrior(Prior):
    """The same Beta(alpha0, beta0) for every prompt (the paper's uniform prior is alpha0 = beta0 = 1)."""

    def __init__(self, alpha0: float = 1.0, beta0: float = 1.0) -> None:
        self.alpha0 = float(alpha0)
        self.beta0 = float(beta0)

    def params(self, pool_index: np.ndarray) -> dict[str, np.ndarray]:
        m = len(pool_index)
        return {"alpha0": np.full(m, self.alpha0), "beta0": np.full(m, self.beta0)}


@runtime_checkable
class Layered(Protocol):
    """A prior that adds per-prompt evidence on top of a population prior (``base``)."""

    base: Prior


@runtime_checkable
class GroupedPopulation(Protocol):
    """A population prior split by prompt groups (``sara.priors.grouped``, ``sara.priors.features``)."""

    default_reweight: Reweight
    """What ``sara:reweight`` resolves to when the spec leaves it unset (``SARAConfig.reweight``)."""

    def unit_groups(self, pool_index: np.ndarray) -> np.ndarray: ...

    def composition_weights(self, k: int) -> np.ndarray: ...


def population_of(prior: Prior) -> Prior:
    """The population prior under ``prior``: its ``base`` for a per-prompt history, else ``prior`` itself."""
    return prior.base if isinstance(prior, Layered) else prior
