"""Priors: everything that says how hard a prompt is before or between its rollouts.

``Prior`` (``base``) is the interface; ``ConstantPrior`` the paper's uniform Beta; ``EmpiricalBayesPrior`` (``beta``)
one Beta fitted to the population; ``GridPrior`` (``grid``) a mixture over success rates fitted by EM, split per group
of prompts by ``GroupedGridPrior`` (``grouped``); ``HistoryPrior`` / ``BorrowedHistory`` (``history``) each prompt's
own decayed evidence over a population prior. ``posteriors`` holds the vectorized Beta-Binomial closed forms.
"""

from __future__ import annotations

from sara.config import ConfigError
from sara.priors.base import ConstantPrior, Layered, Prior, population_of
from sara.priors.beta import EmpiricalBayesPrior
from sara.priors.grid import GridPrior
from sara.priors.grouped import GroupedGridPrior
from sara.priors.history import BorrowedHistory, HistoryPrior, HistorySource

__all__ = ["PRIOR_KINDS", "BorrowedHistory", "ConstantPrior", "EmpiricalBayesPrior", "GridPrior", "GroupedGridPrior",
           "HistoryPrior", "HistorySource", "Layered", "Prior", "make_prior", "population_of"]

PRIOR_KINDS = ("constant", "empirical", "history")


def make_prior(kind: str, *, alpha0: float = 1.0, beta0: float = 1.0, decay: float = 0.7,
               max_evidence: float = 64.0) -> Prior:
    """``"constant"`` -> ``ConstantPrior``; ``"empirical"`` -> ``EmpiricalBayesPrior``; ``"history"`` ->
    ``HistoryPrior`` over an empirical-Bayes base. ``alpha0``/``beta0`` are the constant prior or the starting point."""
    if kind == "constant":
        return ConstantPrior(alpha0, beta0)
    if kind == "empirical":
        return EmpiricalBayesPrior(alpha0, beta0)
    if kind == "history":
        return HistoryPrior(decay, EmpiricalBayesPrior(alpha0, beta0), max_evidence=max_evidence)
    raise ConfigError(f"prior: field 'prior': unknown prior {kind!r}; known: {', '.join(PRIOR_KINDS)}")
