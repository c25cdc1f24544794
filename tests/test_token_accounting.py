"""Token accounting: every generated token is counted once, by fate (committed / abandoned / discarded / aborted),
prompt (prefill) tokens once per generated rollout, in synchronous rounds and streaming, for every kind of
allocator; and the trainer carries them (and its seconds by phase) into ``metrics.jsonl`` and the run summary."""

from __future__ import annotations

import pytest

from sara.allocators import make_allocator
from sara.driver import collect
from sara.envs.task_env import TaskEnv
from sara.samplers import UniformSampler
from sara.testing.scripted import prompt_text
from sara.testing.streaming import STREAM_TASK, CoinArithmetic


class Ledger(CoinArithmetic):
    """``CoinArithmetic`` that books every completion it generates: delivered (``generate`` or a finished ``poll``),
    or aborted (the tokens ``abort`` reports), with the prompt tokens it was given."""

    def __init__(self, slots: int = 16) -> None:
        super().__init__(slots)
        self.delivered_tokens = self.delivered_prompt_tokens = self.aborted_tokens = 0
        self._prompt_len: dict[int, int] = {}

    def generate(self, requests, sampling):
        out = super().generate(requests, sampling)
        self.delivered_tokens += sum(c.num_tokens for cs in out for c in cs)
        self.delivered_prompt_tokens += sum(len(c.prompt_token_ids) for cs in out for c in cs)
        return out

    def submit(self, items, sampling):
        super().submit(items, sampling)
        self._prompt_len.update({int(t): len(prompt_text(r)) for t, r in items})

    def poll(self, timeout=None):
        out = super().poll(timeout)
        self.delivered_tokens += sum(c.num_tokens for _, c in out)
        self.delivered_prompt_tokens += sum(self._prompt_len[t] for t, _ in out)
        return out

    def abort(self, tags):
        got = super().abort(tags)
        self.aborted_tokens += got
        return got


@pytest.mark.parametrize("barrier", [True, False], ids=["rounds", "stream"])
@pytest.mark.parametrize("spec", ["uniform", "ds", "sara", "sara:probe=2"])
def test_every_generated_token_is_counted_once_by_fate(spec, barrier):
    engine = Ledger(slots=16)
    env = TaskEnv(STREAM_TASK, engine, scorer_mode="inline")
    res = collect(make_allocator(spec, k=4), env, UniformSampler(len(env.prompts), seed=3), target_groups=8, seed=3,
                  driver={"barrier": barrier})
    s = res.stats
    assert engine.delivered_tokens > 0
    assert s.tokens == engine.delivered_tokens  # nothing delivered is lost, nothing counted twice
    assert s.tokens == s.committed_tokens + s.abandoned_tokens + s.discarded_tokens
    assert s.committed_tokens == sum(g.num_tokens for g in res.groups)
    assert s.abandoned_tokens == sum(g.num_tokens for g in res.abandoned)
    assert s.discarded_tokens == sum(g.num_tokens for g in res.discarded)
    assert s.aborted_tokens == engine.aborted_tokens  # cancelled rollouts: in no group, counted apart
    assert s.prompt_tokens == engine.delivered_prompt_tokens > 0
    if barrier:
        assert s.aborted_tokens == 0


def test_a_backend_without_prompt_ids_counts_no_prompt_tokens():
    engine = Ledger(slots=16)
    engine.prompt_ids = False
    env = TaskEnv(STREAM_TASK, engine, scorer_mode="inline")
    res = collect(make_allocator("ds", k=4), env, UniformSampler(len(env.prompts), seed=0), target_groups=4, seed=0)
    assert res.stats.tokens > 0 and res.stats.prompt_tokens == 0


def _cfg(tmp_path, **overrides):
    from sara.train import TrainConfig

    return TrainConfig(**{"task": "sara/Arithmetic-v0:max_digits=1,pool_size=60,eval_size=4", "k": 4,
                          "groups_per_step": 3, "steps": 3, "eval": {"num_prompts": 2, "samples": 1, "greedy": False},
                          "policy_options": {"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 15}},
                          "threads": 1, "progress": False, "tensorboard": False, "out_dir": str(tmp_path),
                          **overrides})


@pytest.mark.parametrize("allocator", ["sara:probe=2", "ds:max_oversample=64"])
def test_the_run_reports_tokens_by_fate_trained_tokens_and_seconds_by_phase(tmp_path, allocator):
    pytest.importorskip("torch")
    from sara.metrics import read_jsonl
    from sara.train import Trainer
    from sara.train.summary import FATES, PHASES

    with Trainer(_cfg(tmp_path, allocator=allocator, surplus="train")) as trainer:
        summary = trainer.train(log=True)
    fates = summary.tokens_by_fate
    assert set(fates) == set(FATES)
    assert fates["committed"] + fates["abandoned"] + fates["discarded"] == summary.tokens > 0
    # surplus=train: every committed group is trained once, so the loss saw exactly the committed tokens
    assert summary.trained_tokens == fates["committed"] > 0
    assert summary.prompt_tokens > 0
    assert set(summary.seconds_by_phase) == set(PHASES)
    assert 0 < sum(summary.seconds_by_phase.values()) <= summary.wall_seconds
    last = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    for fate in FATES:
        assert last[f"env/cum_{fate}_tokens"] == fates[fate]
    assert last["env/cum_prompt_tokens"] == summary.prompt_tokens
    assert last["train/cum_trained_tokens"] == summary.trained_tokens
    for phase in PHASES:
        assert last[f"time/cum_{phase}"] == pytest.approx(summary.seconds_by_phase[phase])


def test_banked_groups_are_trained_tokens_once(tmp_path):
    """surplus=bank: the trained tokens are the committed groups' tokens less what is still in the bank."""
    pytest.importorskip("torch")
    from sara.train import Trainer

    with Trainer(_cfg(tmp_path, allocator="ds:max_oversample=64")) as trainer:
        for _ in range(3):
            trainer.train_step()
        banked = sum(g.num_tokens for g in trainer.bank.groups)
        summary = trainer.summary()
    assert summary.trained_tokens == summary.tokens_by_fate["committed"] - banked
