"""Surplus committed groups (``TrainConfig.surplus``, ``sara.train.bank``): banked, the batch stays
``groups_per_step`` and the surplus is trained in the next step, one weight update stale, with fresh group ids; flushed
at the run's last step; carried in checkpoints so a resumed run trains the same batches; 'train' grows the batch."""

from __future__ import annotations

import numpy as np
import pytest

from sara.train.bank import SurplusBank, batch_reward_variance
from sara.train.codec import decode, encode
from sara.types import Decision, Group, Prompt, Rollout

PROMPTS = [Prompt(id=f"p{i}", prompt=f"{i}+1=", answer={"value": i + 1}) for i in range(10)]


def _group(gid: int, pool_index: int, rewards=(0.0, 1.0), version=None) -> Group:
    rollouts = tuple(Rollout(prompt_id=f"p{pool_index}", pool_index=pool_index, completion=str(r), reward=r,
                             num_tokens=2, seed=gid * 10 + j, token_ids=(1, 2), logprobs=(-0.5, -0.25),
                             prompt_token_ids=(3,), policy_version=version)
                     for j, r in enumerate(rewards))
    return Group(group_id=gid, prompt=PROMPTS[pool_index], pool_index=pool_index, rollouts=rollouts,
                 decision=Decision.COMMIT, metadata={"p_eff": 0.5})


def test_the_batch_keeps_its_size_and_the_surplus_opens_the_next_one():
    bank = SurplusBank(3)
    assert bank.need() == 3
    first = bank.batch([_group(i, i, version=0) for i in range(5)])
    assert [g.pool_index for g in first] == [0, 1, 2] and len(bank) == 2 and bank.need() == 1
    # the banked groups keep the weights version that generated them; the learner trains them as stale rows
    assert all(r.policy_version == 0 for g in bank.groups for r in g.rollouts)
    second = bank.batch([_group(0, 5, version=1), _group(1, 6, version=1)])  # ids 0 and 1 again: unique per step
    assert [g.pool_index for g in second] == [3, 4, 5] and [g.group_id for g in second] == [0, 1, 2]
    assert [r.policy_version for g in second for r in g.rollouts] == [0, 0, 0, 0, 1, 1]
    assert [g.pool_index for g in bank.groups] == [6] and bank.groups[0].rollouts[0].policy_version == 1


def test_lag_is_one_update_even_when_the_bank_outgrows_a_batch():
    bank = SurplusBank(2)
    bank.batch([_group(i, i) for i in range(6)])  # 4 banked: more than a batch
    assert bank.need() == 1
    nxt = bank.batch([_group(0, 9)])
    assert [g.pool_index for g in nxt] == [2, 3, 4, 5] and len(bank) == 1  # every banked group trains now


def test_flush_and_mode_train_train_everything():
    bank = SurplusBank(2)
    bank.batch([_group(i, i) for i in range(3)])
    assert [g.pool_index for g in bank.batch([_group(0, 5), _group(1, 6)], flush=True)] == [2, 5, 6]
    assert len(bank) == 0
    train = SurplusBank(2, "train")
    assert len(train.batch([_group(i, i) for i in range(5)])) == 5 and len(train) == 0 and train.need() == 2


def test_batch_reward_variance_is_the_mean_within_group_variance():
    groups = [_group(0, 0, rewards=(0.0, 1.0)), _group(1, 1, rewards=(1.0, 0.0, 0.0, 0.0)),
              _group(2, 2, rewards=(1.0, 1.0, 1.0))]
    assert batch_reward_variance(groups) == pytest.approx((0.25 + 0.1875 + 0.0) / 3)
    assert batch_reward_variance([]) == 0.0


def test_the_bank_round_trips_through_the_checkpoint_codec():
    bank = SurplusBank(1)
    bank.batch([_group(0, 0), _group(7, 4, rewards=(1.0, 0.0, 1.0), version=2), _group(8, 2)])
    tree, tensors = encode(bank.state_dict())
    restored = SurplusBank(1)
    restored.load_state_dict(decode(tree, tensors), PROMPTS)
    assert restored.groups == bank.groups
    assert np.array_equal(restored.groups[0].rewards, [1.0, 0.0, 1.0])


@pytest.mark.parametrize("args", [(0, "bank"), (2, "drop")])
def test_invalid_settings_are_rejected(args):
    with pytest.raises(ValueError):
        SurplusBank(*args)


# ---- in the trainer ----------------------------------------------------------------------------------------------
def _cfg(tmp_path, **overrides):
    from sara.train import TrainConfig

    return TrainConfig(**{"task": "sara/Arithmetic-v0:max_digits=1,pool_size=60,eval_size=4", "k": 4,
                          "groups_per_step": 3, "steps": 4, "eval": {"num_prompts": 2, "samples": 1, "greedy": False},
                          "policy_options": {"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 15}},
                          "threads": 1, "progress": False, "tensorboard": False, "out_dir": str(tmp_path),
                          "allocator": "ds:max_oversample=64", **overrides})  # a surplus to bank


def _steps(trainer, n):
    return [trainer.train_step() for _ in range(n)]


def test_the_trainer_banks_surplus_groups_and_trains_each_once(tmp_path):
    pytest.importorskip("torch")
    from sara.train import Trainer

    with Trainer(_cfg(tmp_path)) as trainer:
        ms = _steps(trainer, 4)
    committed = [m["alloc/committed_groups"] for m in ms]
    batches = [m["train/batch_groups"] for m in ms]
    assert max(committed[:-1]) > 3, "the run must produce a surplus for this test to mean anything"
    assert batches[:-1] == [3.0] * 3 and sum(batches) == sum(committed)  # every committed group trained once
    assert ms[-1]["train/banked_groups"] == 0  # the last step flushes
    assert all(0.0 < m["train/group_reward_var"] <= 0.25 for m in ms)  # committed groups are mixed
    stale = [m["algo/stale_fraction"] for m, prev in zip(ms[1:], ms) if prev["train/banked_groups"] > 0]
    assert stale and all(s > 0 for s in stale)
    with Trainer(_cfg(tmp_path / "train", surplus="train")) as trainer:
        ms = _steps(trainer, 4)
    assert [m["train/batch_groups"] for m in ms] == [m["alloc/committed_groups"] for m in ms]
    assert all(m["algo/stale_fraction"] == 0 for m in ms)


def test_a_checkpoint_holds_the_bank_and_a_resumed_run_trains_the_same_batches(tmp_path):
    pytest.importorskip("torch")
    from sara.metrics import deterministic_view
    from sara.train import Trainer

    with Trainer(_cfg(tmp_path / "full")) as trainer:
        full = _steps(trainer, 4)
    cut = next(i for i, m in enumerate(full[:-1]) if m["train/banked_groups"] > 0) + 1
    with Trainer(_cfg(tmp_path / "cut")) as trainer:
        head = _steps(trainer, cut)
        assert len(trainer.bank) > 0
        path = trainer.save()
    with Trainer(_cfg(tmp_path / "cut")) as resumed:
        resumed.load(path)
        assert len(resumed.bank) == full[cut - 1]["train/banked_groups"]
        tail = _steps(resumed, 4 - cut)
    strip = lambda ms: deterministic_view([{k: v for k, v in m.items() if not k.startswith("time/")} for m in ms])  # noqa: E731
    assert strip(head + tail) == strip(full)


def test_the_step_that_spends_the_rollout_budget_flushes_the_bank(tmp_path):
    pytest.importorskip("torch")
    from sara.train import Trainer

    with Trainer(_cfg(tmp_path / "free")) as trainer:  # where DS commits a surplus: the first step (5 for 3)
        free = _steps(trainer, 1)
    assert free[0]["train/banked_groups"] > 0, "no surplus to flush"
    budget = int(free[0]["alloc/rollouts"])
    with Trainer(_cfg(tmp_path / "budget", steps=50, rollout_budget=budget)) as trainer:
        ms = _steps(trainer, 1)  # the same step; it spends the budget exactly
        assert trainer.budget_spent() and len(trainer.bank) == 0
    assert [m["alloc/committed_groups"] for m in ms] == [m["alloc/committed_groups"] for m in free]
    assert ms[0]["train/batch_groups"] > free[0]["train/batch_groups"]  # the surplus trained, not banked


def test_the_trainer_logs_what_the_sampler_reports(tmp_path):
    pytest.importorskip("torch")
    from sara.train import Trainer

    with Trainer(_cfg(tmp_path / "auto", sampler="predictive:decay=auto", steps=2)) as trainer:
        ms = _steps(trainer, 2)
    assert [m["sampler/decay"] for m in ms] == [0.7, 0.7]  # where decay=auto starts; revisits move it
    with Trainer(_cfg(tmp_path / "uniform", steps=1)) as trainer:
        assert not [key for key in trainer.train_step() if key.startswith("sampler/")]
