"""Tree rollouts: groups whose rollouts share partial traces, and the ``sara_tree`` allocator (per-node decisions).

**What a group is.** A tree is grown per prompt: the prompt branches into up to ``branches`` partial traces (branch
nodes: the first segment of a solution), and each branch node is continued by leaves (full rollouts that share that
segment). The group handed to the algorithms is *all leaves of one prompt's tree*: the same prompt, any size >= 1,
keyed by the unit id like every other group, so GRPO / RLOO / Dr.GRPO baselines are the tree's leaf mean. A
tree-aware environment puts each leaf's branch into ``Rollout.metadata["branch"]`` for algorithms that want
per-subtree baselines; nothing else changes for them.

**Allocation: decisions per node.** The unit table holds one row per tree (its leaves' sufficient statistics, so
SARA's tree-level rule and every prior work unchanged) and the allocator keeps per-node state beside it: the leaves under
each branch node. For every leaf it starts:

* tree level (``sara_paper``'s rule): COMMIT a mixed tree, ABANDON when p_eff < tau_low, else CONTINUE;
* node level, for a tree that continues: every new leaf goes to the node that buys the most evidence per token: a
  *new branch* (a whole rollout's tokens, one independent leaf's worth of evidence) or *deepening* the shallowest
  branch node (only the suffix, ``1 - shared_fraction`` of the tokens, but under within-branch correlation ``rho`` its
  ``m+1``-th leaf adds only ``(m+1)/(1+m rho) - m/(1+(m-1) rho)`` independent leaves' worth). So a subtree keeps
  growing while it is cheap information and stops once its leaves mostly echo each other: weakly correlated leaves
  give deep, narrow trees, strongly correlated ones breadth first. ``nodes=round_robin`` is the fixed schedule (leaf
  j under branch j mod branches) for comparison;
* a committed tree is filled to k leaves level by level over ``branches`` branch nodes (the shape the algorithms
  expect: every branch gets k/branches leaves when possible).

p_eff accounts for the correlation by the design effect: ``m`` leaves of one branch carry ``m / (1 + (m - 1) rho)``
independent rollouts' worth of evidence, for the observed prefix (actual leaves per node) and for the completed tree
(the fill's final shape), in the Beta-Binomial closed form with non-integer counts. With ``rho = 0`` it is exactly
``sara_paper``.

Node choices reach a tree-aware environment as node handles (``sara.handles``) when ``node_prefix=true``; the
simulator is ``sara.envs.sim.tree.TreeSimulatedEnv``, text backends use ``sara.envs.tree.TreeTaskEnv``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

import numpy as np
from numpy.typing import ArrayLike
from pydantic import Field

from sara.allocators.boundary import ProtocolError
from sara.allocators.effectiveness import EffectivenessModel
from sara.allocators.paper import SARAPaperAllocator, SARAPaperConfig
from sara.handles import format_handle, parse_handle
from sara.priors.base import Prior
from sara.priors.history import HistoryPrior
from sara.priors.posteriors import log_p_all_fail, log_p_all_succeed
from sara.units import UnitStatus, UnitTable

__all__ = ["TreeConfig", "TreeEffectiveness", "TreeSARAAllocator", "effective_size", "effective_size_of",
           "format_handle", "parse_handle", "water_fill"]


def effective_size(n: ArrayLike, branches: int, rho: float) -> np.ndarray:
    """Design-effect size of the first ``n`` leaves of a round-robin tree (see ``effective_size_of``)."""
    n = np.asarray(n, np.float64)[..., None]
    c = np.arange(branches)
    return effective_size_of(np.floor(n / branches) + (c < np.mod(n, branches)), rho)


def effective_size_of(leaves: ArrayLike, rho: float) -> np.ndarray:
    """Design-effect size of a tree with ``leaves[..., c]`` leaves under branch c: sum of ``m / (1 + (m - 1) rho)``."""
    m = np.asarray(leaves, np.float64)
    return cast(np.ndarray, np.sum(np.where(m > 0, m / (1.0 + np.maximum(m - 1.0, 0.0) * rho), 0.0), axis=-1))


def water_fill(leaves: ArrayLike, extra: ArrayLike) -> np.ndarray:
    """Leaves per branch after adding ``extra[u]`` leaves to tree u level by level (fewest-leaves branch first).

    Vectorized closed form over trees: the final shape is ``max(m_c, L)`` for the highest level L the extra leaves
    reach, plus one more leaf on some branches at level L for the remainder. Branch order within a tree is not kept
    (only the multiset of counts, which is all the design effect needs). Shapes: ``[U, B]``, ``[U]`` -> ``[U, B]``.
    """
    m = np.sort(np.asarray(leaves, np.float64), axis=-1)
    r = np.asarray(extra, np.float64)[..., None]
    i = np.arange(1, m.shape[-1] + 1, dtype=np.float64)
    level = np.floor((r + np.cumsum(m, axis=-1)) / i)  # level if the i lowest branches were raised together
    nxt = np.concatenate([m[..., 1:], np.full(m.shape[:-1] + (1,), np.inf)], axis=-1)
    ok = (level >= m) & ((level < nxt) | np.isinf(nxt))
    idx = m.shape[-1] - 1 - np.argmax(ok[..., ::-1], axis=-1)  # the valid band (exactly one exists)
    lev = np.take_along_axis(level, idx[..., None], axis=-1)
    out = np.maximum(m, lev)
    left = (r[..., 0] - np.sum(out - m, axis=-1)).astype(np.int64)  # < number of branches at the level
    bump = (np.cumsum(out == lev, axis=-1) <= left[..., None]) & (out == lev)
    return cast(np.ndarray, out + bump)


class TreeEffectiveness(EffectivenessModel):
    """Binary leaves, Beta prior per tree, design-effect correction for within-branch correlation ``rho``.

    ``leaves`` (set by the allocator) holds the actual leaves per branch node of every unit ``[M, branches]``; without
    it the round-robin shape is assumed. The completed tree is the observed one water-filled to k leaves.
    """

    reward_range = (0.0, 1.0)

    def __init__(self, branches: int, rho: float) -> None:
        self.branches, self.rho = int(branches), float(rho)
        self.leaves: np.ndarray | None = None

    def is_mixed(self, table: UnitTable, idx: np.ndarray, eps: float) -> np.ndarray:
        return cast(np.ndarray, (table.rmax[idx] - table.rmin[idx]) > eps)

    def shapes(self, table: UnitTable, idx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Leaves per branch now and after the fill to k, ``[len(idx), branches]`` each."""
        n = table.n[idx].astype(np.float64)
        if self.leaves is not None and len(self.leaves) >= len(table):
            now = self.leaves[idx].astype(np.float64)
        else:
            c = np.arange(self.branches)
            now = np.floor(n[:, None] / self.branches) + (c < np.mod(n[:, None], self.branches))
        return now, water_fill(now, np.maximum(k - n, 0.0))

    def p_effective(self, table: UnitTable, idx: np.ndarray, k: int) -> np.ndarray:
        a = table.prior.get("alpha0", np.ones(len(table)))[idx]
        b = table.prior.get("beta0", np.ones(len(table)))[idx]
        n = table.n[idx].astype(np.float64)
        s = np.rint(table.rsum[idx])
        now, final = self.shapes(table, idx, k)
        n_eff = effective_size_of(now, self.rho)
        k_eff = np.maximum(effective_size_of(final, self.rho), n_eff)
        s_eff = np.where(n > 0, s * n_eff / np.maximum(n, 1.0), 0.0)
        # Unmixed prefixes only reach here: s == 0 (all fail) or s == n (all succeed), both possible when n == 0.
        lf = log_p_all_fail(n_eff, np.where(s == 0, 0.0, 1.0), k_eff, a, b)
        ls = log_p_all_succeed(n_eff, np.where(s == n, n_eff, s_eff - 1.0), k_eff, a, b)
        return cast(np.ndarray, np.clip(1.0 - np.exp(lf) - np.exp(ls), 0.0, 1.0))


class TreeConfig(SARAPaperConfig):
    """``sara_paper``'s options plus the tree shape and the node policy."""

    branches: int = Field(4, ge=1, le=64)
    """Branch nodes (partial traces) per prompt at most; a filled tree spreads its k leaves over this many."""
    rho: float = Field(0.3, ge=0.0, lt=1.0)
    """Assumed correlation of two leaves' outcomes under one branch node (design effect in p_eff; sets how fast a
    subtree's information runs out). 0 = independent leaves."""
    shared_fraction: float = Field(0.5, ge=0.0, lt=1.0)
    """Assumed share of a leaf's tokens in its branch's shared segment: deepening a branch costs ``1 - this`` of a
    new branch. 0 = token cost is not a concern (new branches first, the most informative per rollout)."""
    nodes: Literal["adaptive", "round_robin"] = "adaptive"
    """'adaptive': each probing leaf goes to the node (new branch or an existing branch) with the best chance of
    breaking the tree's pattern per token; 'round_robin': the fixed schedule leaf j -> branch j mod branches."""
    node_prefix: bool = False
    """Send node handles '<tree:STEP.UNIT:B:+0,0,...>' as request prefixes (for TreeSimulatedEnv / TreeTaskEnv only;
    never for plain text tasks, which would append the handle to the prompt)."""


class TreeSARAAllocator(SARAPaperAllocator):
    """``sara_tree``: the paper's thresholds per tree on a correlation-aware p_eff, and a per-node choice of where each
    new leaf grows (see the module docstring).

    Per-step node state: ``leaves[u, c]`` (delivered leaves under branch node c of tree u), ``opened[u]`` (branch
    nodes opened by delivered leaves), and the same two counting the leaves in flight (``placed``,
    ``placed_opened``), which the node policy places new leaves against. ``dispatch`` chooses the node of every leaf
    it starts (``node_of[u, j]`` for the tree's j-th leaf); ``prefix`` sends those choices to a tree-aware
    environment; ``credit`` (called by ``finished``) credits each delivered leaf to its node by its index j. Trees are not carried over
    between steps.
    """

    name = "sara_tree"
    Config = TreeConfig
    config: TreeConfig
    model: TreeEffectiveness
    carries_over = False  # per-node state does not travel with a carried unit

    def __init__(self, config: TreeConfig | Mapping[str, Any] | None = None, *, prior: Prior | None = None,
                 history: HistoryPrior | None = None, **overrides: object) -> None:
        super().__init__(config, prior=prior, history=history, **overrides)
        self._reset_nodes()

    def _reset_nodes(self) -> None:
        b, k = self.config.branches, self.k
        self.model = TreeEffectiveness(b, self.config.rho)
        self.leaves = np.zeros((0, b), np.int64)
        self.opened = np.zeros(0, np.int64)
        self.placed = np.zeros((0, b), np.int64)
        self.placed_opened = np.zeros(0, np.int64)
        self.node_of = np.zeros((0, k), np.int64)  # branch node of the tree's j-th leaf (-1: not dispatched)
        self.opens_of = np.zeros((0, k), bool)  # whether that leaf opens its branch
        self.dispatched = np.zeros(0, np.int64)
        self._last: tuple[np.ndarray, np.ndarray, np.ndarray] = (np.zeros(0, np.int64),) * 3
        self.model.leaves = self.leaves

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._reset_nodes()

    def begin_step(self, target_groups: int, *, step: int | None = None, max_rollouts: int | None = None,
                   lookahead: int = 0) -> None:
        super().begin_step(target_groups, step=step, max_rollouts=max_rollouts, lookahead=lookahead)
        self._reset_nodes()

    def admit(self, pool_index: np.ndarray) -> np.ndarray:
        ids = super().admit(pool_index)
        m, b, k = len(ids), self.config.branches, self.k
        self.leaves = np.concatenate([self.leaves, np.zeros((m, b), np.int64)])
        self.opened = np.concatenate([self.opened, np.zeros(m, np.int64)])
        self.placed = np.concatenate([self.placed, np.zeros((m, b), np.int64)])
        self.placed_opened = np.concatenate([self.placed_opened, np.zeros(m, np.int64)])
        self.node_of = np.concatenate([self.node_of, np.full((m, k), -1, np.int64)])
        self.opens_of = np.concatenate([self.opens_of, np.zeros((m, k), bool)])
        self.dispatched = np.concatenate([self.dispatched, np.zeros(m, np.int64)])
        self.model.leaves = self.leaves
        return ids

    # ---- node policy ---------------------------------------------------------------------------------------------
    def _place(self, ids: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Branch nodes ``[len(ids), max(counts)]`` (and whether each leaf opens its node) of ``counts[i]`` new leaves
        of the distinct trees ``ids``, vectorized over trees, one pass per leaf position.

        Probing (the tree is undecided): a leaf under a branch node that already has ``m`` leaves adds
        ``(m+1)/(1+m rho) - m/(1+(m-1) rho)`` independent leaves' worth of evidence (the design effect) for
        ``1 - shared_fraction`` of a rollout's tokens; a leaf on a new branch adds 1 for a whole rollout. The shallowest
        branch keeps growing while its evidence per token beats a new branch's, else a new branch opens (while fewer
        than ``branches`` are open). Filling (committed): level by level over all ``branches`` nodes.
        """
        c, b = self.config, self.config.branches
        m = self.placed[ids].copy()
        opened = self.placed_opened[ids].copy()
        filling = self.units.status[ids] == UnitStatus.FILLING
        width = int(counts.max(initial=0))
        nodes = np.full((len(ids), width), -1, np.int64)
        opens = np.zeros((len(ids), width), bool)
        rows = np.arange(len(ids))
        start = self.placed[ids].sum(1)
        for r in range(width):
            act = counts > r
            if c.nodes == "round_robin":
                node = (start + r) % b
            else:
                # Filling: level by level over all branch nodes; unopened ones have 0 leaves, so they open first.
                fill_node = np.argmin(m, axis=1)
                level = np.where(np.arange(b) < opened[:, None], m, np.iinfo(np.int64).max)
                shallow = np.argmin(level, axis=1)
                m_min = level[rows, shallow].astype(np.float64)
                gain = (m_min + 1) / (1 + m_min * c.rho) - m_min / (1 + np.maximum(m_min - 1, 0) * c.rho)
                worth = gain > 1.0 - c.shared_fraction
                deepen = (opened > 0) & (worth | (opened >= b))
                probe_node = np.where(deepen, shallow, opened)
                node = np.where(filling, fill_node, probe_node)
            new = act & (node >= opened)
            node = np.where(act, node, -1)
            nodes[:, r], opens[:, r] = node, new
            m[rows[act], node[act]] += 1
            opened += new
        return nodes, opens

    def dispatch(self, free: int, only: np.ndarray | None = None) -> np.ndarray:
        """The template's dispatch, and a branch node for every leaf started (against delivered + in-flight leaves)."""
        ids = super().dispatch(free, only)
        uids, inv, counts = np.unique(ids, return_inverse=True, return_counts=True)
        nodes, opens = self._place(uids, counts)
        rank = _rank_within(ids)
        node, opened = nodes[inv.reshape(-1), rank], opens[inv.reshape(-1), rank]
        j = self.dispatched[ids] + rank
        self.node_of[ids, j], self.opens_of[ids, j] = node, opened
        np.add.at(self.dispatched, ids, 1)
        np.add.at(self.placed, (ids, node), 1)
        np.maximum.at(self.placed_opened, ids, node + 1)
        self._last = (ids, node, opened)
        return ids

    def prefix(self, unit_ids: np.ndarray) -> list[str]:
        """Node handles of the leaves just dispatched (with ``node_prefix``), one per leaf."""
        unit_ids = np.asarray(unit_ids, np.int64)
        if not self.config.node_prefix:
            return [""] * len(unit_ids)
        ids, node, opened = self._last
        if not np.array_equal(ids, unit_ids):
            raise ValueError("sara_tree.prefix: call it with the unit ids the last dispatch returned")
        b = self.config.branches
        return [format_handle(self.step, u, b, [c], [o]) for u, c, o in zip(ids.tolist(), node.tolist(),
                                                                            opened.tolist())]

    def credit(self, unit_ids: np.ndarray, index: np.ndarray | None) -> None:
        """Credit each delivered leaf to the node it was dispatched to (``index``: the leaf's j)."""
        who = self._who("finished")
        if index is None:
            raise ProtocolError(f"{who}: needs each leaf's index within its tree (index=)")
        if (index >= self.k).any():
            raise ProtocolError(f"{who}: leaf index {int(index.max())} of a tree of k={self.k} leaves (indices "
                                f"0..{self.k - 1}); pass the index j each leaf was dispatched with")
        node = self.node_of[unit_ids, index]
        if (node < 0).any():
            raise ProtocolError(f"{who}: rewards for leaves that were never dispatched (unit "
                                f"{int(unit_ids[node < 0][0])}, index {int(index[node < 0][0])})")
        np.add.at(self.leaves, (unit_ids, node), 1)
        np.maximum.at(self.opened, unit_ids, node + 1)

    def abort(self, unit_ids: np.ndarray) -> None:
        """Cancelled leaves leave their nodes: placement counts fall back to the delivered leaves."""
        super().abort(unit_ids)
        unit_ids = np.asarray(unit_ids, np.int64)  # checked by the template's abort
        self.placed[unit_ids] = self.leaves[unit_ids]
        self.placed_opened[unit_ids] = self.opened[unit_ids]

    def node_shape(self, unit_id: int) -> list[int]:
        """Leaves under each opened branch node of a tree (for inspection and tests)."""
        return cast(list[int], self.leaves[unit_id, : self.opened[unit_id]].tolist())


def _rank_within(ids: np.ndarray) -> np.ndarray:
    """Position of each entry among the equal ids before it (0, 1, 2, ... per id, in order)."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    first = np.searchsorted(sorted_ids, sorted_ids, side="left")
    rank = np.empty(len(ids), np.int64)
    rank[order] = np.arange(len(ids)) - first
    return rank
