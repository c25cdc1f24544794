"""Predictive prompt selection (DPS / MoPPS-style): pick the prompts most likely to give a mixed group.

Each prompt keeps a discounted Beta posterior of its success rate (``HistoryPrior``: evidence decays by ``decay`` per
step toward an empirical-Bayes population prior; by default the decay is chosen online by how well it predicts
revisits). When the allocator wants ``m`` prompts, the sampler draws a candidate pool of ``m * candidate_ratio``
prompts (uniformly, without the ones already drawn this step), Thompson-samples a success rate ``p~`` for each from
its posterior, and takes the ``m`` candidates with the largest ``P(mixed group of k | p~) = 1 - p~^k - (1 - p~)^k``. A
fraction ``explore`` of each draw is taken from the least-visited candidates instead (a round robin over the pool, so
nothing starves). Thompson sampling plus decay keeps every prompt revisitable: an all-fail prompt's posterior widens
again as its evidence ages, so it is retried after a while (that is what makes drift visible).

It composes with any allocator ("SARA + DPS"): the sampler decides *which* prompts enter, the allocator decides how
many rollouts each gets. The driver feeds the step's observations back through ``update``.

A prompt never drawn has no evidence of its own, so under the sampler's own Beta every unseen prompt scores alike and
selection among them is uniform. An allocator with a population prior over a grid of success rates split into
groups (``sara`` when it splits the pool: one mixture per value of a prompt feature under ``group_by``, learned from
the features under ``group_by=auto``) has it built before either component (``sara.build.build_allocation``), and
the sampler gets it at construction (``allocator_population``; the allocator fits it, the sampler reads it); the sampler
then scores each candidate under its group's mixture times the prompt's own decayed likelihood, so an unseen prompt
of a band that rarely mixes (always solved, never solved) is passed over before its first rollout. That is the
default, ``population=allocator``; ``population=own`` keeps the sampler's Beta whoever it is composed with.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

import numpy as np
from pydantic import Field

from sara.config import SaraModel, validate_config
from sara.priors.beta import EmpiricalBayesPrior
from sara.priors.grid import GridPrior, grid_posterior
from sara.priors.history import DEFAULT_DECAY, Decay, HistoryPrior
from sara.priors.posteriors import p_effective
from sara.samplers.base import PromptSampler

__all__ = ["PredictiveSampler", "PredictiveSamplerConfig"]


class PredictiveSamplerConfig(SaraModel):
    """Options of the predictive sampler."""

    k: int = Field(8, ge=2)
    """Group size the mixed-group probability is computed for."""
    candidate_ratio: float = Field(8.0, ge=1.0, le=1024.0)
    """Candidates scored per prompt selected (DPS uses 8-32)."""
    decay: Decay = DEFAULT_DECAY
    """Per-step weight of a prompt's past evidence (lambda, in (0, 1]). Higher keeps a visit's evidence until the
    prompt's next visit, which pays while the policy moves slowly and costs once it learns fast (docs/beyond.md,
    section 3, has both measured). "auto" (the default, ``sara.priors.history.DEFAULT_DECAY``): chosen online among
    ``sara.priors.history.AUTO_DECAYS`` by how well each predicts the outcomes of revisited prompts."""
    selection: Literal["thompson", "mean"] = "thompson"
    """'thompson': score a Thompson draw of each candidate's success rate; 'mean': score the posterior-predictive
    probability of a mixed group (greedier; exploration then comes from ``explore`` and decay only)."""
    explore: float = Field(0.05, ge=0.0, le=1.0)
    """Fraction of each draw given to the least-visited candidates (on top of Thompson sampling): keeps discovering
    prompts that became useful, and bounds starvation."""
    max_evidence: float = Field(64.0, gt=0.0)
    """Cap on a prompt's decayed pseudo-count, so confident prompts can still be revisited after drift."""
    population: Literal["own", "allocator"] = "allocator"
    """Prior under each prompt's history: 'allocator' (the default), the grid population the run's allocator fits,
    given at construction (``sara``'s, one mixture per prompt group under ``group_by``; see the module docstring), or the
    sampler's Beta when none is lent (``ds``, ``uniform``, ``sara`` on one population); 'own', always the sampler's
    empirical-Bayes Beta (unseen prompts score alike)."""


class PredictiveSampler(PromptSampler):
    """Thompson-sampled mixed-group probability from per-prompt discounted Beta posteriors; unlimited epochs.

    Args:
        pool_size: Prompts in the pool.
        seed: Seed of every random choice (candidates, Thompson draws).
        allocator_population: The run allocator's grid population split by prompt group (fitted by the allocator,
            read here); scored under when ``population=allocator``, else ignored.
        **options: ``PredictiveSamplerConfig`` fields (``k``, ``candidate_ratio``, ``decay``, ``explore``, ...).
    """

    name = "predictive"
    Config = PredictiveSamplerConfig
    takes_k = True
    takes_population = True

    def __init__(self, pool_size: int, *, seed: int = 0, allocator_population: GridPrior | None = None,
                 **options: object) -> None:
        super().__init__(pool_size, seed=seed)
        self.config = validate_config(PredictiveSamplerConfig, options, what="sampler 'predictive'")
        c = self.config
        self.posterior = HistoryPrior(c.decay, EmpiricalBayesPrior(), max_evidence=c.max_evidence)
        self.visits = np.zeros(self.pool_size, np.int64)  # times each prompt was drawn (starvation analysis)
        self._taken = np.zeros(self.pool_size, bool)  # drawn in the running step
        self._calls = 0  # draws in the running step (seeds the draw)
        self.population = allocator_population if c.population == "allocator" else None  # read, never updated

    def scores(self, pool_index: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Probability that a size-k group of each prompt is mixed (Thompson draw or posterior predictive)."""
        k = self.config.k
        if self.population is not None:
            return self._grid_scores(self.population, np.asarray(pool_index, np.int64), rng)
        prm = self.posterior.params(pool_index)
        if self.config.selection == "mean":
            return np.asarray(p_effective(0, 0, k, prm["alpha0"], prm["beta0"]))
        p = rng.beta(prm["alpha0"], prm["beta0"])
        return 1.0 - p**k - (1.0 - p) ** k

    def _grid_scores(self, pop: GridPrior, idx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``scores`` under the lent population ``pop``: each prompt's posterior over the grid is its group's mixture
        times the likelihood of its decayed history; Thompson draws a grid point from it, 'mean' integrates."""
        k = self.config.k
        post = grid_posterior(pop.group_weights()[pop.unit_groups(idx)], pop.grid, *self.posterior.evidence(idx))
        mixed = 1.0 - pop.grid**k - (1.0 - pop.grid) ** k  # [G]
        if self.config.selection == "mean":
            return post @ mixed
        cdf = np.cumsum(post, 1)
        at = np.minimum((cdf < rng.random((len(idx), 1)) * cdf[:, -1:]).sum(1), len(mixed) - 1)
        return cast(np.ndarray, mixed[at])

    def sample(self, m: int) -> np.ndarray:
        free = np.flatnonzero(~self._taken)
        m = min(int(m), len(free))
        if m <= 0:
            return np.zeros(0, np.int64)
        rng = np.random.default_rng([self.seed, self.posterior.step, self._calls])
        self._calls += 1
        c = min(len(free), max(m, int(np.ceil(m * self.config.candidate_ratio))))
        cand = rng.choice(free, size=c, replace=False)
        n_explore = int(rng.binomial(m, self.config.explore)) if self.config.explore > 0 else 0
        # Exploration first: the least-visited candidates (random tie-break), so every prompt is revisited in turn.
        by_visits = np.lexsort((rng.random(len(cand)), self.visits[cand]))
        explore = cand[by_visits[:n_explore]]
        rest = cand[by_visits[n_explore:]]
        score = self.scores(rest, rng)
        greedy = rest[np.argsort(-score, kind="stable")[: m - n_explore]]
        out: np.ndarray = np.concatenate([greedy, explore]).astype(np.int64)
        self._taken[out] = True
        np.add.at(self.visits, out, 1)
        return out

    def update(self, pool_index: np.ndarray, n: np.ndarray, rsum: np.ndarray, step: int) -> None:
        self.posterior.update(pool_index, n, rsum, step)
        self._taken[:] = False
        self._calls = 0

    def metrics(self) -> dict[str, float]:
        """``sampler/decay``: the decay in use (with ``decay=auto``, the one the revisits chose)."""
        return {"sampler/decay": self.posterior.decay}

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "posterior": self.posterior.state_dict(), "visits": self.visits.copy(),
                "taken": self._taken.copy(), "calls": self._calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.posterior.load_state_dict(state["posterior"])
        self.visits = np.asarray(state["visits"], np.int64).copy()
        self._taken = np.asarray(state["taken"], bool).copy()
        self._calls = int(state["calls"])
