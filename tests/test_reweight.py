"""``sara:reweight=ds``: trained groups' advantages weighted so the batch has DS's expected composition over the prior's
groups (``GroupedGridPrior.composition_weights``, ``SARAAllocator.batch_weights``, ``sara.train.reweight``)."""

import numpy as np
import pytest

from sara.allocators import WeighsBatch, make_allocator
from sara.build import build_allocation
from sara.config import ConfigError
from sara.driver import collect
from sara.envs.sim.binary import SimulatedEnv
from sara.priors.grouped import GroupedGridPrior
from sara.samplers import UniformSampler
from sara.types import Decision, Group, Prompt, Rollout

K = 8


def test_composition_weights_are_ds_mixing_over_the_rules_commit_rate():
    prior = GroupedGridPrior(np.array([0] * 10 + [1] * 10), fit=False)
    # Group 0: 4 units, all complete and mixed. Group 1: 6 units, 5 abandoned after one failure, 1 mixed.
    prior.update(np.arange(4), np.full(4, K), np.full(4, 4.0), step=0)
    prior.update(np.arange(10, 16), np.array([1, 1, 1, 1, 1, K]), np.array([0, 0, 0, 0, 0, 3.0]), step=1)
    g = prior.grid
    ds = prior.group_w @ (1 - g**K - (1 - g) ** K)  # equal across groups: nothing fitted
    expect = ds / np.array([(4 + 1) / (4 + 2), (1 + 1) / (6 + 2)])
    np.testing.assert_allclose(prior.composition_weights(K), expect)
    assert prior.composition_weights(K)[1] > 3 * prior.composition_weights(K)[0]


def _allocator(spec: str, steps: int = 3):
    """A rule on a pool whose 'hard' half (p = 0.05) it abandons early and whose 'mid' half (p = 0.4) it commits."""
    rates = np.concatenate([np.full(600, 0.05), np.full(600, 0.4)])
    prompts = [Prompt(id=f"p{i}", metadata={"band": "hard" if i < 600 else "mid"}) for i in range(len(rates))]
    env = SimulatedEnv(rates)
    allocator, sampler = build_allocation(spec, UniformSampler(len(rates), seed=0), k=K, prompts=prompts)
    for t in range(steps):
        res = collect(allocator, env, sampler, target_groups=32, seed=0, step=t)
    return allocator, res


def test_batch_weights_favour_the_group_the_rule_starves():
    allocator, _ = _allocator("sara:group_by=band,reweight=ds,max_weight=10")
    assert isinstance(allocator, WeighsBatch)
    idx, sizes = np.array([0, 1, 700, 701, 702]), np.array([8, 3, 8, 8, 5])  # two hard groups, three mid ones
    hard = np.repeat(idx < 600, sizes)
    w = allocator.batch_weights(idx, sizes)
    assert w.shape == (int(sizes.sum()),) and w.mean() == pytest.approx(1.0)
    assert np.ptp(w[hard]) == 0 and np.ptp(w[~hard]) == 0  # one weight per group of prompts
    assert w[hard][0] > 2 * w[~hard][0]
    # The cap bounds a row's weight relative to the batch mean (then the weights are renormalized to mean 1).
    capped, _ = _allocator("sara:group_by=band,reweight=ds,max_weight=1.2")
    wc = capped.batch_weights(idx, sizes)
    assert wc.max() / wc.min() < w.max() / w.min() and wc.mean() == pytest.approx(1.0)


@pytest.mark.parametrize("spec", ["sara:group_by=band", "sara:group_by=none,reweight=ds"])
def test_no_weights_without_reweight_or_without_groups(spec):
    allocator, res = _allocator(spec, steps=1)
    assert allocator.batch_weights(np.array([g.pool_index for g in res.groups]),
                                   np.array([g.size for g in res.groups])) is None


def test_reweight_is_a_checked_option():
    with pytest.raises(ConfigError, match="reweight"):
        make_allocator("sara:reweight=composition", k=K)
    with pytest.raises(ConfigError, match="max_weight"):
        make_allocator("sara:max_weight=0.5", k=K)


class _Fixed:
    def __init__(self, w):
        self.w = w

    def batch_weights(self, pool_index, sizes):
        return self.w


def _groups():
    def rollout(i: int, r: float) -> Rollout:
        return Rollout(prompt_id=f"p{i}", pool_index=i, completion="x", reward=r, num_tokens=1)

    return [Group(group_id=i, prompt=Prompt(id=f"p{i}"), pool_index=i, decision=Decision.COMMIT,
                  rollouts=tuple(rollout(i, float(j % 2)) for j in range(n))) for i, n in enumerate((2, 3))]


def test_weigh_advantages_scales_rows_and_reports_the_largest():
    torch = pytest.importorskip("torch")
    from sara.train.reweight import weigh_advantages

    adv = torch.ones(5, 4)
    extra = {"metrics": {}}
    w = np.array([0.5, 0.5, 1.0, 1.5, 1.5])
    out = weigh_advantages(_Fixed(w), _groups(), adv, extra)
    torch.testing.assert_close(out, torch.as_tensor(w, dtype=adv.dtype)[:, None].expand(5, 4))
    assert extra["metrics"]["algo/max_row_weight"] == 1.5
    assert weigh_advantages(_Fixed(None), _groups(), adv, {}) is adv  # no weights: untouched
    assert weigh_advantages(object(), _groups(), adv, {}) is adv  # not a WeighsBatch
    with pytest.raises(ValueError, match="4 weights for 5 rows"):
        weigh_advantages(_Fixed(w[:4]), _groups(), adv, {})


def test_the_trainer_trains_with_the_weights(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import sara.train.trainer as trainer_mod
    from sara.train import TrainConfig, Trainer

    seen = []
    real = trainer_mod.weigh_advantages

    def spy(allocator, groups, advantages, extra):
        out = real(allocator, groups, advantages, extra)
        seen.append((advantages, out))
        return out

    monkeypatch.setattr(trainer_mod, "weigh_advantages", spy)
    cfg = TrainConfig(task="sara/Arithmetic-v0:max_digits=2,pool_size=60,eval_size=4", k=4, groups_per_step=3, steps=2,
                      allocator="sara:group_by=digits,reweight=ds", eval={"num_prompts": 2, "samples": 1,
                                                                           "greedy": False},
                      policy_options={"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}},
                      threads=1, progress=False, tensorboard=False, out_dir=str(tmp_path))
    with Trainer(cfg) as trainer:
        metrics = [trainer.train_step() for _ in range(2)]
    assert all("algo/max_row_weight" in m for m in metrics if m["train/batch_groups"] > 0)
    assert len(seen) == 2 and all(o is not a for a, o in seen if a is not None)  # the learner got the weighted ones
