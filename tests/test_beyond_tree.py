"""Tree rollouts (issue 5): design effect, tree simulator (correlation, shared prefixes), allocator, groups."""

import numpy as np
import pytest

from sara import SimulatedEnv, UniformSampler, collect
from sara.allocators import make_allocator, p_effective
from sara.allocators.base import UnitTable
from sara.allocators.tree import TreeEffectiveness, TreeSimulatedEnv, effective_size
from sara.testing import check_allocator
from sara.types import Prompt, RolloutRequest


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


def _requests(env, n_trees, k, handles):
    return [RolloutRequest(unit_id=u, pool_index=u % len(env.rates), prompt=Prompt(id=str(u)),
                           seeds=tuple(range(u * k + 1, u * k + k + 1)),
                           prefix=f"<tree:0.{u}:0:4>" if handles else "") for u in range(n_trees)]


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
                            prefix="<tree:0.3:0:4>"),
             RolloutRequest(unit_id=3, pool_index=3, prompt=Prompt(id="3"), seeds=tuple(range(29, 33)),
                            prefix="<tree:0.3:4:4>")]
    parts = env.rollout(split)
    assert [r.reward for r in whole[3]] == [r.reward for p in parts for r in p]


def test_sara_tree_conforms_with_and_without_handles():
    check_allocator(make_allocator("sara_tree:node_prefix=true", k=8), target_groups=16, steps=2, seeds=(0,),
                    env_factory=lambda s: TreeSimulatedEnv("u-shaped", size=3000, seed=s))
    check_allocator(make_allocator("sara_tree:branches=3,rho=0.5", k=6), target_groups=16, steps=2, seeds=(1,))


def test_groups_are_whole_trees_and_cheaper_in_tokens_than_flat_sara():
    def run(spec):
        env = TreeSimulatedEnv("u-shaped", size=6000, seed=2)
        return collect(make_allocator(spec, k=8), env, UniformSampler(6000, seed=2), target_groups=128, seed=2)

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
