"""``sara:group_by=KEY``: one population prior per group of prompts, one optimum across them."""

import numpy as np
import pytest

from sara.allocators import make_allocator
from sara.allocators.optimal import rule_figures, rule_tables
from sara.build import build_allocation
from sara.config import ConfigError
from sara.driver import collect
from sara.envs.sim.binary import SimulatedEnv
from sara.priors import BorrowedHistory
from sara.priors.features import FeatureGroupedPrior
from sara.priors.grid import GridPrior
from sara.priors.grouped import MAX_GROUPS, GroupedGridPrior, group_labels
from sara.samplers import UniformSampler
from sara.testing import check_allocator
from sara.types import Prompt

K = 8


def _pool(size: int = 1200) -> tuple[np.ndarray, list[Prompt]]:
    """Half never solvable (p = 0), half at p = 0.2: after one failure the two halves look alike to ONE prior."""
    half = size // 2
    rates = np.concatenate([np.zeros(half), np.full(size - half, 0.2)])
    prompts = [Prompt(id=f"p{i}", metadata={"band": "hard" if i < half else "mid"}) for i in range(size)]
    return rates, prompts


def _cost(spec: str, steps: int = 8, seed: int = 0) -> tuple[float, object]:
    rates, prompts = _pool()
    env = SimulatedEnv(rates)
    allocator, sampler = build_allocation(spec, UniformSampler(len(rates), seed=seed), k=K, prompts=prompts)
    rollouts = effective = 0
    for t in range(steps):
        res = collect(allocator, env, sampler, target_groups=32, seed=seed, step=t)
        rollouts, effective = rollouts + res.stats.rollouts, effective + res.stats.effective_groups
    return rollouts / effective, allocator


def test_group_labels_follow_the_metadata_key():
    prompts = [Prompt(id="a", metadata={"c": "x"}), Prompt(id="b", metadata={"c": "y"}), Prompt(id="c"),
               Prompt(id="d", metadata={"c": "x"}), Prompt(id="e", metadata={"c": [1, 2]})]
    labels, names = group_labels(prompts, "c")
    assert names == ["x", "y", None, (1, 2)]
    assert labels.tolist() == [0, 1, 2, 0, 3]
    with pytest.raises(ConfigError, match="group_by.*no prompt has metadata key 'level'.*c"):
        group_labels(prompts, "level")
    many = [Prompt(id=str(i), metadata={"c": i}) for i in range(MAX_GROUPS + 1)]
    with pytest.raises(ConfigError, match="group_by.*distinct values"):
        group_labels(many, "c")


def test_grouped_fit_separates_what_the_pooled_fit_blurs():
    rates, prompts = _pool()
    labels, names = group_labels(prompts, "band")
    rng = np.random.default_rng(0)
    idx = rng.choice(len(rates), 400, replace=False)
    n = np.full(len(idx), K)
    s = rng.binomial(K, rates[idx])
    pooled = GridPrior(min_units=1)
    pooled.update(idx, n, s.astype(float), 0)
    grouped = GroupedGridPrior(labels, names, min_units=1)
    grouped.update(idx, n, s.astype(float), 0)
    hard, mid = names.index("hard"), names.index("mid")
    assert grouped.group_weights()[hard][0] > 0.9  # the hard band's mass sits at p = 0
    assert grouped.group_weights()[mid][0] < 0.1
    rho, tf, _ = rule_tables(grouped, K)
    _, pf, _ = rule_tables(pooled, K)
    assert tf[hard, 1] and not tf[mid, 1:].any()  # hard: abandon after one failure; mid: never
    # Exactly on the population: grouping is cheaper per effective group.
    g = [rule_figures(tf[i], np.zeros(K + 1, bool), rates[labels == i], K) for i in (hard, mid)]
    grouped_cost = sum(f["rollouts"] for f in g) / sum(f["effective"] for f in g)
    pooled_cost = rule_figures(pf[0], np.zeros(K + 1, bool), rates, K)["rollouts_per_effective_group"]
    assert grouped_cost < 0.85 * pooled_cost
    assert rho == pytest.approx(grouped_cost, rel=0.1)


def test_group_by_costs_fewer_rollouts_per_effective_group_in_collect():
    pooled, _ = _cost("sara:group_by=none")
    grouped, allocator = _cost("sara:group_by=band")
    assert isinstance(allocator.prior, GroupedGridPrior)
    assert grouped < 0.9 * pooled, (grouped, pooled)


def test_a_group_without_data_stays_at_the_pooled_fit():
    labels = np.array([0] * 100 + [1] * 5)
    prior = GroupedGridPrior(labels, min_units=1, shrink=16.0)
    rng = np.random.default_rng(1)
    idx = np.arange(100)
    prior.update(idx, np.full(100, K), rng.binomial(K, 0.5, 100).astype(float), 0)
    assert np.abs(prior.group_weights()[1] - prior.weights).max() < 0.02


def test_the_builder_wires_prompts_and_the_predictive_history():
    rates, prompts = _pool(200)
    with pytest.raises(ConfigError, match="group_by.*prompts"):
        build_allocation("sara:group_by=band", UniformSampler(len(rates), seed=0), k=K)
    with pytest.raises(ConfigError, match="group_by.*prompts"):  # built alone, it has no pool to split
        make_allocator("sara:group_by=band", k=K)
    allocator, _ = build_allocation("sara:group_by=band", "predictive", k=K, prompts=prompts, seed=0)
    assert isinstance(allocator.prior, BorrowedHistory) and isinstance(allocator.prior.base, GroupedGridPrior)
    history, _ = build_allocation("sara:group_by=band,prior=history", UniformSampler(200, seed=0), k=K, prompts=prompts)
    assert isinstance(history.prior.base, GroupedGridPrior)
    plain, _ = build_allocation("sara", UniformSampler(200, seed=0), k=K, prompts=prompts)
    assert type(plain.prior) is GridPrior  # the default key (component) is absent: one population, no error
    bare = [Prompt(id=f"p{i}") for i in range(200)]
    one, _ = build_allocation("sara:group_by=component|auto", UniformSampler(200, seed=0), k=K, prompts=bare)
    assert type(one.prior) is GridPrior  # prompts without features: auto finds no split, one population


def test_the_default_groups_a_mixtures_components():
    prompts = [Prompt(id=f"p{i}", metadata={"component": "easy" if i % 3 else "hard"}) for i in range(60)]
    default, _ = build_allocation("sara", UniformSampler(60, seed=0), k=K, prompts=prompts)
    assert isinstance(default.prior, GroupedGridPrior) and default.prior.names == ["hard", "easy"]
    off, _ = build_allocation("sara:group_by=none", UniformSampler(60, seed=0), k=K, prompts=prompts)
    assert type(off.prior) is GridPrior
    unwired, _ = build_allocation("sara", UniformSampler(60, seed=0), k=K)  # no prompts: no error
    assert type(unwired.prior) is GridPrior
    paper, _ = build_allocation("sara_paper", UniformSampler(60, seed=0), k=K, prompts=prompts)
    assert type(paper.prior).__name__ == "ConstantPrior"  # the paper rule has one population, never grouped


def test_group_by_tries_its_keys_in_order():
    prompts = [Prompt(id=f"p{i}", metadata={"band": "hard" if i % 2 else "mid", "level": i % 3}) for i in range(60)]

    def prior(spec: str, pool: list[Prompt] = prompts) -> object:
        return build_allocation(spec, UniformSampler(len(pool), seed=0), k=K, prompts=pool)[0].prior

    first, fallback = prior("sara:group_by=band|level"), prior("sara:group_by=component|level")
    assert isinstance(first, GroupedGridPrior) and first.names == ["mid", "hard"]
    assert isinstance(fallback, GroupedGridPrior) and fallback.names == [0, 1, 2]
    assert isinstance(prior("sara:group_by=source|auto"), FeatureGroupedPrior)
    labelled = [Prompt(id=f"p{i}", metadata={"component": "a" if i % 2 else "b", "band": i % 3}) for i in range(60)]
    mixture = prior("sara:group_by=component|auto", labelled)
    assert isinstance(mixture, GroupedGridPrior) and mixture.names == ["b", "a"]  # a mixture: its components
    assert isinstance(prior("sara:group_by=component|auto"), FeatureGroupedPrior)  # no component: learned
    with pytest.raises(ConfigError, match=r"group_by.*any of the metadata keys \['source', 'x'\].*band"):
        prior("sara:group_by=source|x")
    with pytest.raises(ConfigError, match="group_by.*put it last"):
        make_allocator("sara:group_by=auto|band", k=K)
    with pytest.raises(ConfigError, match="group_by.*empty or 'none'"):
        make_allocator("sara:group_by=band|none", k=K)
    assert make_allocator("sara", k=K).config.group_keys == ("component", "<embedding>")
    assert make_allocator("sara:group_by=none", k=K).config.group_keys == ()


def test_group_by_is_the_optimal_rules_option():
    with pytest.raises(ConfigError, match="group_by"):
        make_allocator("sara_paper:group_by=band", k=K)
    with pytest.raises(ConfigError, match="tau_low"):
        make_allocator("sara:group_by=band,tau_low=0.3", k=K)


def test_state_round_trip_and_conformance():
    rates, prompts = _pool(400)
    _, allocator = _cost("sara:group_by=band", steps=2)
    state = allocator.prior.state_dict()
    labels, names = group_labels(_pool()[1], "band")
    fresh = GroupedGridPrior(labels, names)
    fresh.load_state_dict(state)
    assert np.array_equal(fresh.group_weights(), allocator.prior.group_weights())
    assert rule_tables(fresh, K)[0] == pytest.approx(rule_tables(allocator.prior, K)[0])
    wrong = GroupedGridPrior(np.zeros(10, np.int64))
    with pytest.raises(ValueError, match="groups"):
        wrong.load_state_dict(state)
    check_allocator(lambda: build_allocation("sara:group_by=band", UniformSampler(len(rates), seed=0), k=K, prompts=prompts)[0], env_factory=lambda seed: SimulatedEnv(rates, seed=seed))


@pytest.mark.parametrize("spec", ["sara", "sara:group_by=band", "sara_paper:tau_low=0.3"])
def test_config_survives_a_state_round_trip(spec):
    # The full config is stored and re-validated: every field of a rule is that rule's own, so nothing flips.
    _, prompts = _pool(200)
    allocator = build_allocation(spec, "uniform", k=K, prompts=prompts).allocator
    fresh = build_allocation(spec, "uniform", k=K, prompts=prompts).allocator
    fresh.load_state_dict(allocator.state_dict())
    assert fresh.config == allocator.config and type(fresh.config) is type(allocator.config)


def test_the_trainer_hands_its_pool_to_group_by(tmp_path):
    pytest.importorskip("torch")
    from sara.train import TrainConfig, Trainer

    def cfg(allocator: str) -> TrainConfig:
        return TrainConfig(task="sara/Arithmetic-v0:max_digits=2,pool_size=60,eval_size=4", k=4, groups_per_step=3,
                           steps=1, allocator=allocator, eval={"num_prompts": 2, "samples": 1, "greedy": False},
                           policy_options={"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}},
                           threads=1, progress=False, tensorboard=False, out_dir=str(tmp_path))

    with Trainer(cfg("sara:group_by=digits")) as trainer:
        prior = trainer.allocator.prior
        assert isinstance(prior, GroupedGridPrior) and prior.n_groups >= 3  # (1, 1), (1, 2), (2, 1), (2, 2)
        assert len(prior.labels) == len(trainer.env.prompts)
        trainer.train_step()
    with pytest.raises(ConfigError, match="group_by.*'level'"):
        Trainer(cfg("sara:group_by=level"))


def test_drain_false_keeps_the_batch_near_the_target():
    rates = np.concatenate([np.full(600, 0.5), np.full(600, 0.05)])
    env = SimulatedEnv(rates)
    out = {}
    for spec in ("sara", "sara:drain=false"):
        allocator = make_allocator(spec, k=K)
        sampler = UniformSampler(len(rates), seed=0)
        effective = rollouts = 0
        for t in range(6):
            res = collect(allocator, env, sampler, target_groups=32, seed=0, step=t)
            effective, rollouts = effective + res.stats.effective_groups, rollouts + res.stats.rollouts
        out[spec] = (effective / 6, rollouts / 6)
    assert out["sara:drain=false"][0] < out["sara"][0]  # fewer surplus groups per step
    assert out["sara:drain=false"][1] < out["sara"][1]  # and cheaper steps
