"""Tree rollouts (issue 5): design effect, tree simulator (correlation, shared prefixes), allocator, groups."""

import numpy as np
import pytest

from sara import SimulatedEnv, UniformSampler, collect
from sara.allocators import make_allocator, p_effective
from sara.allocators.tree import TreeEffectiveness, effective_size, water_fill
from sara.bench.beyond import tree_vs_flat
from sara.envs.sim.tree import TreeSimulatedEnv
from sara.handles import format_handle, parse_handle
from sara.step import WrongAbandons
from sara.testing import check_allocator
from sara.types import Prompt, RolloutRequest
from sara.units import UnitTable


def test_effective_size_limits():
    n = np.arange(0, 9)
    assert effective_size(n, 4, 0.0).tolist() == pytest.approx(n.tolist())
    assert effective_size(n, 4, 1.0).tolist() == pytest.approx(np.minimum(n, 4).tolist())  # one per branch
    assert (np.diff(effective_size(n, 4, 0.3)) > 0).all()


def test_rho_zero_is_sara():
    t = UnitTable()
    t.add(np.arange(3))
    t.update(np.array([0, 0, 1, 2, 2, 2]), np.array([0, 0, 1, 1, 1, 1.0]))
    got = TreeEffectiveness(4, 0.0).p_effective(t, np.arange(3), 8)
    assert got.tolist() == pytest.approx(p_effective(np.array([2, 1, 3]), np.array([0, 1, 3]), 8).tolist())


def _rr(u, j0, n, b=4, step=0):
    """Round-robin handle for leaves j0 .. j0+n-1 of tree u."""
    return format_handle(step, u, b, [j % b for j in range(j0, j0 + n)], [j < b for j in range(j0, j0 + n)])


def _requests(env, n_trees, k, handles):
    return [RolloutRequest(unit_id=u, pool_index=u % len(env.rates), prompt=Prompt(id=str(u)),
                           seeds=tuple(range(u * k + 1, u * k + k + 1)),
                           prefix=_rr(u, 0, k) if handles else "") for u in range(n_trees)]


def test_handle_round_trip_and_plain_text_is_not_a_handle():
    h = format_handle(3, 17, 4, [0, 0, 1, 2], [True, False, True, True])
    assert h == "<tree:3.17:4:+0,0,+1,+2>"
    assert parse_handle(h) == (3, 17, 4, [0, 0, 1, 2], [True, False, True, True])
    assert parse_handle("") is None and parse_handle("<tree:1.2:4>") is None and parse_handle("Let x = 3") is None


def test_water_fill_is_level_by_level():
    m = np.array([[0, 0, 0, 0], [3, 1, 0, 0], [2, 2, 2, 2], [5, 0, 0, 0], [1, 1, 0, 0]])
    extra = np.array([8, 4, 1, 2, 0])
    out = water_fill(m, extra)
    assert (out.sum(1) == m.sum(1) + extra).all()
    assert [sorted(r) for r in out.tolist()] == [[2, 2, 2, 2], [1, 2, 2, 3], [2, 2, 2, 3], [0, 1, 1, 5], [0, 0, 1, 1]]
    rng = np.random.default_rng(0)
    m = rng.integers(0, 5, (200, 6))
    extra = rng.integers(0, 20, 200)
    out = water_fill(m, extra)
    assert (out.sum(1) == m.sum(1) + extra).all() and (np.sort(out, 1) >= np.sort(m, 1)).all()
    # Balanced: once the extra leaves reach every branch, the final shape differs by at most one leaf.
    reach = extra >= m.max(1) * m.shape[1] - m.sum(1)
    assert (out.max(1) - out.min(1) <= 1)[reach].all()


def test_tree_leaves_are_correlated_and_share_prefix_tokens():
    env = TreeSimulatedEnv(np.full(50, 0.5), kappa=1.0, seed=0)
    tree = env.rollout(_requests(env, 2000, 8, True))
    flat = env.rollout(_requests(env, 2000, 8, False))
    same = lambda gs: np.mean([len({r.reward for r in g}) == 1 for g in gs])  # noqa: E731
    assert same(tree) > 3 * same(flat)  # correlated branches saturate more often
    tok = lambda gs: sum(r.num_tokens for g in gs for r in g)  # noqa: E731
    assert tok(tree) < 0.8 * tok(flat)  # shared segments counted once
    assert [r.metadata["branch"] for r in tree[0]] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert "branch" not in flat[0][0].metadata


def test_tree_rewards_are_deterministic_and_batching_invariant():
    env = TreeSimulatedEnv("u-shaped", size=100, seed=1)
    whole = env.rollout(_requests(env, 5, 8, True))
    split = [RolloutRequest(unit_id=3, pool_index=3, prompt=Prompt(id="3"), seeds=tuple(range(25, 29)),
                            prefix=_rr(3, 0, 4)),
             RolloutRequest(unit_id=3, pool_index=3, prompt=Prompt(id="3"), seeds=tuple(range(29, 33)),
                            prefix=_rr(3, 4, 4))]
    parts = env.rollout(split)
    assert [r.reward for r in whole[3]] == [r.reward for p in parts for r in p]


def test_sara_tree_conforms_with_and_without_handles():
    check_allocator(make_allocator("sara_tree:node_prefix=true", k=8), target_groups=16, steps=2, seeds=(0,),
                    env_factory=lambda s: TreeSimulatedEnv("u-shaped", size=3000, seed=s))
    check_allocator(make_allocator("sara_tree:branches=3,rho=0.5", k=6), target_groups=16, steps=2, seeds=(1,))


def test_groups_are_whole_trees_and_cheaper_in_tokens_than_flat_sara():
    def run(spec):
        env = TreeSimulatedEnv("u-shaped", size=6000, seed=2)
        return collect(make_allocator(spec, k=8), env, UniformSampler(6000, seed=2), target_groups=128, seed=2,
                       observers=[WrongAbandons(env)])

    tree, flat = run("sara_tree:node_prefix=true"), run("sara")
    g = tree.groups[0]
    assert {r.pool_index for r in g.rollouts} == {g.pool_index} and g.size == 8
    assert sorted(r.metadata["branch"] for r in g.rollouts) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert tree.stats.wrong_abandons is not None
    per = lambda r: r.stats.tokens / r.stats.effective_groups  # noqa: E731
    assert per(tree) < 0.9 * per(flat)


def test_default_sends_no_text_prefix():
    alloc = make_allocator("sara_tree", k=8)
    env = SimulatedEnv("u-shaped", size=100)
    collect(alloc, env, UniformSampler(100), target_groups=2)
    assert alloc.prefix(np.arange(2)) == ["", ""]


@pytest.mark.parametrize("spec, shape", [
    ("sara_tree:rho=0.1", [4, 4]),  # weakly correlated leaves: deepen a branch while it is cheap information
    ("sara_tree:rho=0.5", [2, 2, 2, 2]),  # strongly correlated: a fresh branch per leaf (breadth first)
    ("sara_tree:rho=0.1,shared_fraction=0", [2, 2, 2, 2]),  # tokens not a concern: breadth first
    ("sara_tree:rho=0.1,nodes=round_robin", [2, 2, 2, 2]),
])
def test_node_policy_decides_per_subtree_whether_to_keep_growing(spec, shape):
    alloc = make_allocator(spec + ",tau_low=0,node_prefix=true", k=8)  # never abandon: probe all-fail trees to k
    env = TreeSimulatedEnv(np.zeros(40), seed=0)
    res = collect(alloc, env, UniformSampler(40), target_groups=4, driver={"max_rounds": 8})
    assert len(res.discarded) > 0
    for g in res.discarded:
        assert alloc.node_shape(g.group_id) == shape
        per_branch = np.bincount([r.metadata["branch"] for r in g.rollouts]).tolist()
        assert per_branch == shape  # the environment saw the same node choices


def test_per_node_policy_saves_tokens_when_leaves_are_weakly_correlated():
    rows = tree_vs_flat(pool_size=6000, target_groups=128, seeds=1, kappa=8.0,
                        specs=("sara_tree:node_prefix=true,rho=0.11,nodes=round_robin",
                               "sara_tree:node_prefix=true,rho=0.11"))
    assert rows[1]["tokens_per_effective_group"] < 0.95 * rows[0]["tokens_per_effective_group"]


def test_counterfactual_of_committed_trees_uses_their_realized_nodes():
    env = TreeSimulatedEnv("u-shaped", size=3000, seed=5)
    alloc = make_allocator("sara_tree:node_prefix=true,rho=0.1", k=8)
    res = collect(alloc, env, UniformSampler(3000, seed=5), target_groups=32, seed=5)
    seeds = np.array([[r.seed for r in g.rollouts] for g in res.groups if g.size == 8], np.uint64)
    pool = np.array([g.pool_index for g in res.groups if g.size == 8])
    assert len(seeds) >= 32 and env.counterfactual_mixed(pool, seeds).all()  # committed trees are mixed
