"""Tree rollouts: groups whose rollouts share partial traces, and the ``sara_tree`` allocator.

**What a group is.** A tree is grown per prompt: the prompt branches into up to ``branches`` partial traces (the
first segment of a solution), and each branch is continued by leaves (full rollouts that share that segment). The
group handed to the algorithms is *all leaves of one prompt's tree*: the same prompt, any size >= 1, keyed by the
unit id like every other group, so GRPO / RLOO / Dr.GRPO baselines are the tree's leaf mean. A tree-aware
environment puts each leaf's branch into ``Rollout.metadata["branch"]`` for algorithms that want per-subtree
baselines; nothing else changes for them.

**Allocation.** The allocation unit is a prompt's tree; its nodes are bookkept by rollout index: leaf ``j`` of a tree
hangs off branch ``j mod branches``. So probing opens a new branch with each rollout (breadth first: under
within-branch correlation a fresh partial trace is the most informative next sample) and a committed tree is filled
round-robin across its branches (deepening the subtrees, which costs only suffix tokens). After each round the rule
is SARA's: COMMIT a mixed tree, ABANDON when p_eff < tau_low, else CONTINUE (= keep branching). p_eff accounts for
the correlation ``rho`` of leaves within a branch by the design effect: ``m`` leaves of one branch carry
``m / (1 + (m - 1) rho)`` independent rollouts' worth of evidence, both for the observed prefix and for the completed
tree, in the Beta-Binomial closed form (with non-integer counts). With ``rho = 0`` it is exactly ``sara``.

**Simulator.** ``TreeSimulatedEnv``: a prompt of success rate ``p`` gives branch ``c`` of a tree its own rate
``q_c ~ Beta(kappa p, kappa (1 - p))`` (within-branch correlation ``1 / (kappa + 1)``); leaves are Bernoulli(q_c).
A branch's shared segment (``prefix_fraction`` of a rollout's tokens) is generated once, counted on its first leaf.
Tree identity reaches the simulator through the request prefix: with ``node_prefix=true`` the allocator sends a
node handle ``<tree:STEP.UNIT:J0:B>`` instead of text; requests without a handle are independent rollouts (flat
sampling, the baseline). Real text backends need a tree-aware environment that turns handles into the text of
partial traces; that environment is not part of this module (send no handles to text tasks: the default).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from pydantic import Field
from scipy.special import betaincinv

from sara.allocators.base import EffectivenessModel, UnitTable
from sara.allocators.posteriors import log_p_all_fail, log_p_all_succeed
from sara.allocators.sara import SARAAllocator, SARAConfig
from sara.seeding import derive_seeds, uniform_from_seeds
from sara.types import Rollout, RolloutRequest

__all__ = ["TreeConfig", "TreeEffectiveness", "TreeSARAAllocator", "TreeSimulatedEnv", "branch_of",
           "effective_size", "tree_vs_flat"]

_HANDLE = re.compile(r"^<tree:(\d+)\.(\d+):(\d+):(\d+)>$")


def branch_of(j: ArrayLike, branches: int) -> np.ndarray:
    """Branch of leaf ``j`` in a tree of ``branches`` branches (breadth first, then round-robin)."""
    return np.asarray(j, np.int64) % branches


def effective_size(n: ArrayLike, branches: int, rho: float) -> np.ndarray:
    """Design-effect size of the first ``n`` leaves of a tree: sum over branches of ``m_c / (1 + (m_c - 1) rho)``."""
    n = np.asarray(n, np.float64)[..., None]
    c = np.arange(branches)
    m = np.floor(n / branches) + (c < np.mod(n, branches))  # leaves per branch
    return np.sum(np.where(m > 0, m / (1.0 + np.maximum(m - 1.0, 0.0) * rho), 0.0), axis=-1)


class TreeEffectiveness(EffectivenessModel):
    """Binary leaves, Beta prior per tree, design-effect correction for within-branch correlation ``rho``."""

    def __init__(self, branches: int, rho: float) -> None:
        self.branches, self.rho = int(branches), float(rho)

    def is_mixed(self, table: UnitTable, idx: np.ndarray, eps: float) -> np.ndarray:
        return (table.rmax[idx] - table.rmin[idx]) > eps

    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray:
        a = table.prior.get("alpha0", np.ones(len(table)))[idx]
        b = table.prior.get("beta0", np.ones(len(table)))[idx]
        n = table.n[idx].astype(np.float64)
        s = np.rint(table.rsum[idx])
        n_eff = effective_size(n, self.branches, self.rho)
        k_eff = effective_size(np.full(len(idx), float(k)), self.branches, self.rho)
        s_eff = np.where(n > 0, s * n_eff / np.maximum(n, 1.0), 0.0)
        # Unmixed prefixes only reach here: s == 0 (all fail) or s == n (all succeed), both possible when n == 0.
        lf = log_p_all_fail(n_eff, np.where(s == 0, 0.0, 1.0), k_eff, a, b)
        ls = log_p_all_succeed(n_eff, np.where(s == n, n_eff, s_eff - 1.0), k_eff, a, b)
        return np.clip(1.0 - np.exp(lf) - np.exp(ls), 0.0, 1.0)


class TreeConfig(SARAConfig):
    """SARA's options plus the tree shape."""

    branches: int = Field(4, ge=1)
    """Partial traces (branches) per prompt; leaf j hangs off branch j mod branches. 1 = a single shared prefix."""
    rho: float = Field(0.3, ge=0.0, lt=1.0)
    """Assumed correlation of two leaves' outcomes within a branch (design effect in p_eff). 0 = independent."""
    node_prefix: bool = False
    """Send node handles '<tree:STEP.UNIT:J0:B>' as request prefixes (for TreeSimulatedEnv / tree-aware envs only;
    never for text tasks, which would append the handle to the prompt)."""


class TreeSARAAllocator(SARAAllocator):
    """``sara_tree``: a prompt's tree is the unit; SARA's rule on a correlation-aware p_eff (see module docstring)."""

    name = "sara_tree"
    Config = TreeConfig
    config: TreeConfig

    def __init__(self, config: Any = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.model = TreeEffectiveness(self.config.branches, self.config.rho)

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self.model = TreeEffectiveness(self.config.branches, self.config.rho)

    def prefix(self, unit_ids: np.ndarray) -> list[str]:
        if not self.config.node_prefix:
            return [""] * len(unit_ids)
        n = self.units.n[np.asarray(unit_ids, np.int64)]
        b = self.config.branches
        return [f"<tree:{self.step}.{u}:{j0}:{b}>" for u, j0 in zip(np.asarray(unit_ids).tolist(), n.tolist())]


class TreeSimulatedEnv:
    """Tree-structured simulated rollouts with correlated rewards within a branch (see module docstring).

    Args:
        rates: Success rate per prompt, or a population spec of ``sara.envs.simulated``.
        size: Pool size for a named population.
        seed: Seed of the population and of the branch rates.
        kappa: Branch-rate concentration; within-branch leaf correlation is ``1 / (kappa + 1)``.
        prefix_fraction: Share of a rollout's tokens in its branch's shared segment.
        **env_options: ``SimulatedEnv`` options (token-length model).
    """

    def __init__(self, rates: ArrayLike | str, *, size: int = 10_000, seed: int = 0, kappa: float = 2.0,
                 prefix_fraction: float = 0.5, **env_options: Any) -> None:
        from sara.envs.simulated import SimulatedEnv

        if kappa <= 0 or not 0.0 <= prefix_fraction < 1.0:
            raise ValueError("TreeSimulatedEnv: need kappa > 0 and 0 <= prefix_fraction < 1")
        self.flat = SimulatedEnv(rates, size=size, seed=seed, **env_options)
        self.rates = self.flat.rates
        self.prompts = self.flat.prompts
        self.kappa, self.prefix_fraction, self.seed = float(kappa), float(prefix_fraction), int(seed)
        self._trees: dict[int, tuple[int, int, int]] = {}  # seed of leaf 0 -> (step, unit, branches)

    def _leaf_rewards(self, pool: np.ndarray, seeds: np.ndarray, tree: np.ndarray, j: np.ndarray,
                      branches: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rewards and branch ids of leaves (``tree`` = -1 marks an independent rollout)."""
        c = np.where(tree >= 0, j % np.maximum(branches, 1), -1)
        p = np.clip(self.rates[pool], 1e-9, 1 - 1e-9)
        ub = uniform_from_seeds(derive_seeds(self.seed, pool, tree, c), stream=5)
        q = np.where(tree >= 0, betaincinv(self.kappa * p, self.kappa * (1 - p), ub), self.rates[pool])
        return (uniform_from_seeds(seeds, stream=1) < q).astype(np.float64), c

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        if not requests:
            return []
        counts = np.fromiter((r.n for r in requests), np.int64, count=len(requests))
        meta = np.full((len(requests), 4), -1, np.int64)  # step, unit, j0, branches
        for i, r in enumerate(requests):
            m = _HANDLE.match(r.prefix) if r.prefix else None
            if m:
                meta[i] = [int(x) for x in m.groups()]
                if meta[i, 2] == 0:
                    self._trees[int(r.seeds[0])] = (int(meta[i, 0]), int(meta[i, 1]), int(meta[i, 3]))
        rep = np.repeat(np.arange(len(requests)), counts)
        pool = np.repeat(np.fromiter((r.pool_index for r in requests), np.int64, count=len(requests)), counts)
        seeds = np.fromiter((s for r in requests for s in r.seeds), np.uint64, count=int(counts.sum()))
        j = meta[rep, 2] + (np.arange(len(rep)) - np.repeat(np.cumsum(counts) - counts, counts))
        tree = np.where(meta[rep, 1] >= 0, meta[rep, 0] * 1_000_003 + meta[rep, 1], -1)
        rewards, c = self._leaf_rewards(pool, seeds, tree, j, meta[rep, 3])
        full = self.flat.num_tokens(rewards, seeds).astype(np.float64)
        # Shared segment of the branch: generated once, with its first leaf (j < branches).
        seg = self.prefix_fraction * self.flat.config.mean_tokens * np.exp(
            0.3 * (uniform_from_seeds(derive_seeds(self.seed, pool, tree, c), stream=6) - 0.5))
        tokens = np.where(tree >= 0, (1 - self.prefix_fraction) * full + np.where(j < meta[rep, 3], seg, 0.0), full)
        tokens = np.maximum(np.rint(tokens), 1).astype(np.int64)
        out: list[list[Rollout]] = []
        pos = 0
        for req, n in zip(requests, counts.tolist()):
            out.append([Rollout(prompt_id=req.prompt.id, pool_index=req.pool_index, completion="",
                                reward=float(rewards[x]), num_tokens=int(tokens[x]), seed=int(seeds[x]),
                                metadata={"branch": int(c[x])} if c[x] >= 0 else {})
                        for x in range(pos, pos + n)])
            pos += n
        return out

    def counterfactual_mixed(self, pool_index: np.ndarray, seeds: np.ndarray, eps: float = 1e-6) -> np.ndarray:
        """For analysis: would each full tree (row of ``seeds [m, k]``) have been effective?"""
        m, k = seeds.shape
        keys = np.array([self._trees.get(int(s), (-1, -1, 0)) for s in seeds[:, 0].tolist()], np.int64).reshape(m, 3)
        tree = np.where(keys[:, 1] >= 0, keys[:, 0] * 1_000_003 + keys[:, 1], -1)
        pool = np.repeat(np.asarray(pool_index, np.int64), k)
        j = np.tile(np.arange(k), m)
        r, _ = self._leaf_rewards(pool, seeds.reshape(-1), np.repeat(tree, k), j, np.repeat(keys[:, 2], k))
        return r.reshape(m, k).std(axis=1) > eps


def tree_vs_flat(population: str = "u-shaped", *, pool_size: int = 20_000, target_groups: int = 512, seeds: int = 3,
                 k: int = 8, kappa: float = 2.0, prefix_fraction: float = 0.5,
                 specs: Sequence[str] = ("ds", "sara", "sara_tree:node_prefix=true")) -> list[dict[str, Any]]:
    """Rollouts and tokens per effective group on ``TreeSimulatedEnv`` (trees for specs that send handles, flat
    independent rollouts for the others), same pools and seeds; ratios relative to the first spec."""
    from sara.allocators import make_allocator
    from sara.allocators.samplers import UniformSampler
    from sara.collect import collect

    rows = []
    for spec in specs:
        stats = [collect(make_allocator(spec, k=k), TreeSimulatedEnv(population, size=pool_size, seed=s, kappa=kappa,
                                                                     prefix_fraction=prefix_fraction),
                         UniformSampler(pool_size, seed=s), target_groups=target_groups, seed=s).stats
                 for s in range(seeds)]
        eff = sum(s.effective_groups for s in stats)
        ab = sum(s.abandoned_groups for s in stats)
        rows.append({"allocator": spec, "rollouts_per_effective_group": sum(s.rollouts for s in stats) / eff,
                     "tokens_per_effective_group": sum(s.tokens for s in stats) / eff,
                     "wrong_abandon_rate": sum(s.wrong_abandons or 0 for s in stats) / ab if ab else 0.0,
                     "waste_fraction": 1 - sum(s.effective_rollouts for s in stats) / sum(s.rollouts for s in stats)})
    for r in rows:
        r["ratio_vs_first"] = r["rollouts_per_effective_group"] / rows[0]["rollouts_per_effective_group"]
        r["token_ratio_vs_first"] = r["tokens_per_effective_group"] / rows[0]["tokens_per_effective_group"]
    return rows
