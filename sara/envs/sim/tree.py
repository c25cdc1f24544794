"""``TreeSimulatedEnv``: tree-structured simulated rollouts with correlated rewards within a branch (for ``sara_tree``).

A prompt of success rate ``p`` gives branch ``c`` of a tree its own rate ``q_c ~ Beta(kappa p, kappa (1 - p))``
(within-branch correlation ``1 / (kappa + 1)``); leaves are Bernoulli(q_c). A branch's shared segment
(``prefix_fraction`` of a rollout's tokens) is generated once, with the leaf that opens the branch. Tree identity and
node choices reach the environment through the request prefix: with ``node_prefix=true`` the allocator sends a node
handle ``<tree:STEP.UNIT:B:+0,0,+1>`` (``sara.handles``: the branch node of each leaf of the request, ``+`` = this leaf
opens the branch) instead of text; requests without a handle are independent rollouts (flat sampling, the baseline).
Text backends: ``TreeTaskEnv`` (``sara.envs.tree``) turns handles into partial traces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import betaincinv

from sara.config import ConfigError
from sara.envs.sim.binary import SimulatedEnv
from sara.handles import parse_handle
from sara.seeding import derive_seeds, uniform_from_seeds
from sara.types import Rollout, RolloutRequest

__all__ = ["TreeSimulatedEnv"]


class TreeSimulatedEnv:
    """Tree-structured simulated rollouts with correlated rewards within a branch (see module docstring).

    Args:
        rates: Success rate per prompt, or a population spec (``sara.envs.sim.binary``).
        size: Pool size for a named population.
        seed: Seed of the population and of the branch rates.
        kappa: Branch-rate concentration; within-branch leaf correlation is ``1 / (kappa + 1)``.
        prefix_fraction: Share of a rollout's tokens in its branch's shared segment.
        **env_options: ``SimulatedEnv`` options (token-length model).
    """

    def __init__(self, rates: ArrayLike | str, *, size: int = 10_000, seed: int = 0, kappa: float = 2.0,
                 prefix_fraction: float = 0.5, **env_options: Any) -> None:
        if not kappa > 0:
            raise ConfigError(f"TreeSimulatedEnv: field 'kappa': must be > 0 (got {kappa})")
        if not 0.0 <= prefix_fraction < 1.0:
            raise ConfigError(f"TreeSimulatedEnv: field 'prefix_fraction': must be in [0, 1) (got {prefix_fraction})")
        self.flat = SimulatedEnv(rates, size=size, seed=seed, **env_options)
        self.rates = self.flat.rates
        self.prompts = self.flat.prompts
        self.kappa, self.prefix_fraction, self.seed = float(kappa), float(prefix_fraction), int(seed)
        self._trees: dict[int, tuple[int, int]] = {}  # seed of a tree's first leaf -> (tree key, branches)
        self._nodes: dict[int, list[int]] = {}  # tree key -> branch node of each leaf so far
        self._step = -1

    def _leaf_rewards(self, pool: np.ndarray, seeds: np.ndarray, tree: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Rewards of leaves under branch ``c`` of ``tree`` (``tree`` = -1 marks an independent rollout)."""
        p = np.clip(self.rates[pool], 1e-9, 1 - 1e-9)
        ub = uniform_from_seeds(derive_seeds(self.seed, pool, tree, c), stream=5)
        q = np.where(tree >= 0, betaincinv(self.kappa * p, self.kappa * (1 - p), ub), self.rates[pool])
        return (uniform_from_seeds(seeds, stream=1) < q).astype(np.float64)

    def rollout(self, requests: Sequence[RolloutRequest]) -> list[list[Rollout]]:
        if not requests:
            return []
        tree_l: list[int] = []
        node_l: list[int] = []
        open_l: list[bool] = []
        for r in requests:
            h = parse_handle(r.prefix)
            if h is None:
                tree_l += [-1] * r.n
                node_l += [-1] * r.n
                open_l += [False] * r.n
                continue
            step, unit, branches, nodes, opens = h
            if len(nodes) < r.n:
                raise ValueError(f"tree handle {r.prefix!r} names {len(nodes)} leaves for a request of {r.n}")
            key = step * 1_000_003 + unit
            if step > self._step:  # keep the node records of the running and the previous step only
                self._step = step
                self._nodes = {t: v for t, v in self._nodes.items() if t // 1_000_003 >= step - 1}
                self._trees = {s0: v for s0, v in self._trees.items() if v[0] in self._nodes}
            seen = self._nodes.setdefault(key, [])
            if not seen:
                self._trees[int(r.seeds[0])] = (key, branches)
            seen.extend(nodes[: r.n])
            tree_l += [key] * r.n
            node_l += nodes[: r.n]
            open_l += opens[: r.n]
        counts = np.fromiter((r.n for r in requests), np.int64, count=len(requests))
        pool = np.repeat(np.fromiter((r.pool_index for r in requests), np.int64, count=len(requests)), counts)
        seeds = np.fromiter((s for r in requests for s in r.seeds), np.uint64, count=int(counts.sum()))
        tree, c, opened = np.asarray(tree_l, np.int64), np.asarray(node_l, np.int64), np.asarray(open_l, bool)
        rewards = self._leaf_rewards(pool, seeds, tree, c)
        full = self.flat.num_tokens(rewards, seeds).astype(np.float64)
        # Shared segment of the branch: generated once, with the leaf that opens the branch.
        seg = self.prefix_fraction * self.flat.config.mean_tokens * np.exp(
            0.3 * (uniform_from_seeds(derive_seeds(self.seed, pool, tree, c), stream=6) - 0.5))
        tokens = np.where(tree >= 0, (1 - self.prefix_fraction) * full + np.where(opened, seg, 0.0), full)
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
        """For analysis: would each tree (row of ``seeds [m, k]``), grown to k leaves, have been effective? Its
        realized leaves keep their branch nodes; the missing ones are added level by level (the allocator's fill)."""
        m, k = seeds.shape
        tree = np.full((m, k), -1, np.int64)
        node = np.full((m, k), -1, np.int64)
        for i, s0 in enumerate(seeds[:, 0].tolist()):
            if int(s0) not in self._trees:
                continue
            key, branches = self._trees[int(s0)]
            nodes = list(self._nodes[key][:k])
            per = np.bincount(np.asarray(nodes, np.int64), minlength=branches)[:branches].astype(np.int64)
            while len(nodes) < k:
                c = int(np.argmin(per))
                per[c] += 1
                nodes.append(c)
            tree[i], node[i] = key, nodes
        pool = np.repeat(np.asarray(pool_index, np.int64), k)
        r = self._leaf_rewards(pool, seeds.reshape(-1), tree.reshape(-1), node.reshape(-1))
        return r.reshape(m, k).std(axis=1) > eps
