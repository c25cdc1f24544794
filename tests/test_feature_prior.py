"""``sara:group_by=auto``: the population prior split by the prompt feature that predicts outcomes best, chosen
online by prequential likelihood; and the simulator's featured populations it is measured on."""

from pathlib import Path

import numpy as np
import pytest

from sara.build import build_allocation
from sara.config import ConfigError
from sara.driver import collect
from sara.envs.sim.binary import FEATURED, SimulatedEnv, make_features
from sara.priors import BorrowedHistory
from sara.priors.features import LENGTH, NUMERIC_BINS, FeatureGroupedPrior, feature_splits
from sara.samplers import UniformSampler
from sara.testing import check_allocator
from sara.train.state_checks import check_values
from sara.types import Prompt

K = 8


def _run(spec: str, population: str, *, steps: int = 6, seed: int = 0, size: int = 6000, sampler: str = "uniform"):
    env = SimulatedEnv(population, size=size, seed=seed)
    allocator, smp = build_allocation(spec, sampler, k=K, prompts=env.prompts, seed=seed)
    rollouts = effective = 0
    for t in range(steps):
        res = collect(allocator, env, smp, target_groups=128, seed=seed, step=t)
        rollouts, effective = rollouts + res.stats.rollouts, effective + res.stats.effective_groups
    return rollouts / effective, allocator


def test_feature_splits_cover_categorical_numeric_and_length_features():
    prompts = [Prompt(id=f"p{i}", prompt="x" * (i % 40), metadata={"level": i % 3, "tokens": float(i), "id": f"q{i}",
                                                                    "split": "train", "pair": (i % 2, 1)})
               for i in range(300)]
    splits = feature_splits(prompts)
    assert set(splits) == {"level", "tokens", "pair", LENGTH}  # 'id' (300 strings) and 'split' (one value) are not
    assert splits["level"].tolist()[:6] == [0, 1, 2, 0, 1, 2]
    assert len(np.unique(splits["tokens"])) == NUMERIC_BINS and np.all(np.diff(splits["tokens"]) >= 0)
    assert feature_splits(SimulatedEnv("u-shaped", size=1000).prompts) == {}  # a featureless lazy pool: no scan


def test_featured_populations_carry_their_features():
    for name in FEATURED.names():
        rates, features = make_features(f"features:{name}", 500, seed=1)
        assert rates.shape == (500,) and set(features) == {"band", "size"}
        env = SimulatedEnv(f"features:{name}", size=500, seed=1)
        assert np.array_equal(env.rates, rates)
        assert env.prompts[7].metadata == {"band": int(features["band"][7]), "size": int(features["size"][7])}
    with pytest.raises(ConfigError, match="population"):
        make_features("features:nope", 10)
    with pytest.raises(ConfigError, match="features.*'band' has 3 values for 10"):
        SimulatedEnv(np.zeros(10), features={"band": np.zeros(3)})


def test_auto_finds_an_informative_feature_and_saves_what_the_label_saves():
    none, _ = _run("sara:group_by=none", "features:informative")
    band, _ = _run("sara:group_by=band", "features:informative")
    auto, allocator = _run("sara:group_by=auto", "features:informative")
    assert isinstance(allocator.prior, FeatureGroupedPrior) and allocator.prior.feature in ("band", "size")
    assert auto < 0.95 * none and auto < 1.05 * band


@pytest.mark.parametrize("population", ["features:uninformative", "features:misleading"])
def test_auto_is_never_worse_than_one_population(population):
    none, _ = _run("sara:group_by=none", population)
    auto, allocator = _run("sara:group_by=auto", population)
    assert auto <= none * 1.01
    ds, _ = _run("ds", population)
    assert auto <= 1.02 * ds
    if population == "features:uninformative":
        assert allocator.prior.feature == "none" and auto == none  # nothing beat the pooled fit: the same rule


def test_auto_composes_with_the_predictive_sampler():
    cost, allocator = _run("sara:group_by=auto", "features:informative", sampler="predictive", steps=4)
    assert isinstance(allocator.prior, BorrowedHistory) and isinstance(allocator.prior.base, FeatureGroupedPrior)
    assert np.isfinite(cost)


def test_a_pool_without_features_stays_one_population():
    _, allocator = _run("sara:group_by=auto", "u-shaped", steps=1)
    assert not isinstance(allocator.prior, FeatureGroupedPrior)


def test_state_round_trip_and_conformance():
    _, allocator = _run("sara:group_by=auto", "features:informative", steps=4)
    env = SimulatedEnv("features:informative", size=6000, seed=0)
    fresh, _ = build_allocation("sara:group_by=auto", UniformSampler(6000, seed=0), k=K, prompts=env.prompts)
    fresh.load_state_dict(allocator.state_dict())
    assert fresh.prior.feature == allocator.prior.feature
    assert np.array_equal(fresh.prior.group_weights(), allocator.prior.group_weights())
    assert np.array_equal(fresh.prior.scores, allocator.prior.scores)
    check_values(allocator.state_dict(), Path("ckpt"), "allocator")  # what a resumed trainer accepts: no negatives
    other, _ = build_allocation("sara:group_by=auto", UniformSampler(60, seed=0), k=K, prompts=[Prompt(id=f"p{i}", metadata={"x": i % 2}) for i in range(60)])
    with pytest.raises(ValueError, match="features"):
        other.load_state_dict(allocator.state_dict())
    check_allocator(lambda: build_allocation("sara:group_by=auto", UniformSampler(6000, seed=0), k=K, prompts=env.prompts)[0],
                    env_factory=lambda seed: SimulatedEnv("features:informative", size=6000, seed=seed))
