"""Two GRPO + DS steps on SmolLM2-135M through the fast learner (3-shot 1-digit sums, bfloat16 autocast): the batch is
planned with the 3-shot preamble as its shared prefix, the advantages phase runs no forward (one optimizer step per
batch: old log-probs from the update's own forward), and each update raises the surrogate sum_i A_i log pi(y_i) of
the batch it trained on."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


pytestmark = [pytest.mark.hf, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_path(smollm2_path):
    return smollm2_path


def test_two_steps_on_smollm2_raise_the_surrogate_of_their_batch(model_path, tmp_path):
    from sara.policies.base import PrefixScorer
    from sara.train import TrainConfig, Trainer

    cfg = TrainConfig(task="sara/Arithmetic-v0:max_digits=1,ops=+,pool_size=60,eval_size=37,shots=3", policy="hf",
                      policy_options={"model": str(model_path), "dtype": "float32", "compute_dtype": "bfloat16"},
                      backend="hf", backend_options={"dtype": "bfloat16", "max_batch_size": 64}, algo="grpo",
                      allocator="ds", k=8, groups_per_step=4, steps=2, max_new_tokens=6, optim={"lr": 3e-5},
                      eval={"every": 0, "num_prompts": 4, "samples": 1, "greedy": False}, out_dir=str(tmp_path),
                      progress=False, tensorboard=False, seed=0)
    seen = []
    with Trainer(cfg) as trainer:
        learner = trainer.learner
        assert isinstance(learner.policy, PrefixScorer) and learner.policy.autocast_dtype == torch.bfloat16
        update = learner.update

        def surrogate(b, adv):
            with torch.no_grad():
                return float((adv * learner._score_all(learner.policy, b).logprobs * b.response_mask).sum())

        def spy(b, adv, ret, extra, *, step):
            assert extra["old_logprobs"] is None  # no rollout-time forward
            plan = learner._plan(b)
            before = surrogate(b, adv)
            metrics = update(b, adv, ret, extra, step=step)
            seen.append((plan, before, surrogate(b, adv), metrics))
            return metrics

        learner.update = spy
        steps = [trainer.train_step() for _ in range(2)]
    assert len(seen) == 2
    for (plan, before, after, m), step in zip(seen, steps):
        assert len(plan) == 1 and plan[0].prefix >= 16  # one micro-batch, the 3-shot preamble shared
        assert m["algo/optimizer_steps"] == 1.0 and m["algo/ratio_max"] == pytest.approx(1.0)
        assert after > before, (before, after)
        assert step["time/update"] > 0 and abs(step["algo/gen_logprob_gap"]) < 0.5
