"""Allocator behaviour: registry-wide conformance, decision rules, configs."""

import numpy as np
import pytest

from sara import SimulatedEnv, UniformSampler, collect
from sara.allocators import (
    ALLOCATORS,
    Decision,
    SARAAllocator,
    SARAPaperAllocator,
    SequentialAllocator,
    UnitView,
    make_allocator,
)
from sara.config import ConfigError, parse_spec
from sara.testing import check_allocator


@pytest.mark.parametrize("name", ALLOCATORS.names())
def test_every_registered_allocator_conforms(name):
    check_allocator(make_allocator(name, k=8), target_groups=32, steps=2, seeds=(0,))


@pytest.mark.parametrize("spec", ["sara:probe=2/1", "sara:completion=as_is", "sara:oversample=1",
                                  "sara_paper:tau_high=0.7,tau_low=0.3", "sara_paper:prior=history",
                                  "sara:prior=history", "sara:prior=constant,alpha0=0.3,beta0=0.3",
                                  "ds:gen_batch_prompts=16,max_gen_batches=3"])
def test_variants_conform(spec):
    check_allocator(make_allocator(spec, k=6), target_groups=24, steps=2, seeds=(1,))


def test_sara_paper_abandons_after_four_identical_at_k8():
    a = SARAPaperAllocator(k=8, tau_low=0.45, oversample=1)
    a.begin_step(1, step=0)
    a.admit(np.array([0]))
    for i in range(4):
        ids = a.dispatch(100)
        assert ids.tolist() == [0] and len(a.dispatch(100)) == 0  # one rollout in flight at a time
        closed, dec = a.finished(ids, np.zeros(1))
        if i < 3:
            assert len(closed) == 0
    assert dec.tolist() == [Decision.ABANDON]


def test_sara_commits_mixed_and_fills_to_k():
    a = SARAAllocator(k=8, oversample=1)
    a.begin_step(1, step=0)
    a.admit(np.array([5]))
    a.finished(a.dispatch(8), np.array([1.0]))
    closed, _ = a.finished(a.dispatch(8), np.array([0.0]))
    assert len(closed) == 0  # mixed -> filling
    ids = a.dispatch(100)
    assert ids.tolist() == [0] * 6
    closed, dec = a.finished(ids, np.ones(6))
    assert dec.tolist() == [Decision.COMMIT]


def test_as_is_keeps_variable_size_groups():
    env = SimulatedEnv("uniform", size=2000, seed=0)
    res = collect(make_allocator("sara:completion=as_is", k=8), env, UniformSampler(2000), target_groups=64)
    sizes = {g.size for g in res.groups}
    assert len(sizes) > 2 and min(sizes) >= 2
    assert all(g.is_effective() for g in res.groups)


def test_uniform_commits_saturated_groups_and_ds_drops_them():
    env = SimulatedEnv("u-shaped", size=5000, seed=3)
    uni = collect(make_allocator("uniform", k=8), env, UniformSampler(5000, seed=1), target_groups=100)
    assert uni.stats.rounds == 1 and uni.stats.committed_groups == 100
    assert uni.stats.effective_groups < 100
    ds = collect(make_allocator("ds", k=8), env, UniformSampler(5000, seed=1), target_groups=100)
    assert ds.stats.committed_groups >= 100 and all(g.is_effective() for g in ds.groups)
    assert ds.stats.discarded_groups > 0


def test_ds_max_gen_batches_returns_with_status():
    env = SimulatedEnv(np.zeros(1000), seed=0)  # nothing is ever effective
    res = collect(make_allocator("ds:max_gen_batches=3,gen_batch_prompts=10", k=4), env, UniformSampler(1000),
                  target_groups=5)
    assert res.stats.stop_reason == "allocator_done"
    assert res.stats.rounds == 3 and res.stats.committed_groups == 0 and res.stats.discarded_groups == 30


def test_ds_uses_a_tolerance_not_exact_std():
    rewards_close = np.array([1.0, 1.0 + 1e-12, 1.0, 1.0])
    a = make_allocator("ds:gen_batch_prompts=1", k=4)
    a.begin_step(1, step=0)
    a.admit(np.array([0]))
    _, dec = a.observe(np.zeros(4, np.int64), rewards_close)
    assert dec.tolist() == [Decision.DISCARD]


class AbandonAfterTwo(SequentialAllocator):
    def decide(self, units: UnitView) -> np.ndarray:
        return np.where(units.n >= 2, Decision.ABANDON, Decision.CONTINUE)


def test_one_hook_subclass_works_and_conforms():
    check_allocator(AbandonAfterTwo(k=8), target_groups=24, seeds=(0,))
    env = SimulatedEnv("u-shaped", size=3000, seed=0)
    res = collect(AbandonAfterTwo(k=8), env, UniformSampler(3000), target_groups=50)
    assert all(g.size == 2 for g in res.abandoned)


def test_bad_decide_shape_is_reported():
    class Broken(SequentialAllocator):
        def decide(self, units):
            return np.zeros(1, np.int8)

    env = SimulatedEnv("u-shaped", size=500, seed=0)
    with pytest.raises(ValueError, match="shape"):
        collect(Broken(k=4), env, UniformSampler(500), target_groups=20)


@pytest.mark.parametrize("spec,field", [
    ("sara:k=1", "k"), ("sara_paper:tau_low=1.5", "tau_low"), ("sara_paper:tau_low=0.6,tau_high=0.5", "tau_low"),
    ("sara:alpha0=-1", "alpha0"), ("sara:beta0=0", "beta0"), ("sara:probe=0", "probe"), ("sara:bogus=1", "bogus"),
    ("ds:max_gen_batches=0", "max_gen_batches"), ("sara:oversample=0.5", "oversample"),
])
def test_invalid_configs_name_the_field(spec, field):
    with pytest.raises(ConfigError, match=field):
        make_allocator(spec, k=8)


def test_unknown_allocator_lists_known():
    with pytest.raises(ConfigError, match="known"):
        make_allocator("nope")


def test_spec_parsing_and_entry_points():
    assert parse_spec("sara_paper:tau_low=0.45,probe=1") == ("sara_paper", {"tau_low": "0.45", "probe": "1"})
    assert parse_spec("ds") == ("ds", {})
    assert parse_spec("tests.test_allocators:AbandonAfterTwo") == ("tests.test_allocators:AbandonAfterTwo", {})
    a = make_allocator("sara_paper:tau_low=0.3,probe=2/1", k=6)
    assert a.config.tau_low == 0.3 and a.config.internals.probe == (2, 1) and a.k == 6
    with pytest.raises(ConfigError, match="field 'k'.*disagrees with the run's k=8"):
        make_allocator("ds:k=3", k=8)  # one source of k: the run's
    assert make_allocator("ds:k=8", k=8).k == 8 and make_allocator("ds:k=3").k == 3


def test_registry_rejects_duplicates():
    with pytest.raises(ValueError, match="already registered"):
        ALLOCATORS.register("sara", AbandonAfterTwo)


def test_state_dict_round_trip():
    a = make_allocator("sara", k=8)
    env = SimulatedEnv("u-shaped", size=2000, seed=0)
    collect(a, env, UniformSampler(2000), target_groups=40)
    b = make_allocator("sara", k=8)
    b.load_state_dict(a.state_dict())
    assert b.metrics() == a.metrics() and b.state_dict() == a.state_dict()
