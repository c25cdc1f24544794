"""A run that cannot go well stops with one line: a step where nothing is effective stops at its rollout bound, a
non-finite update stops before the weights go anywhere, ``--resume`` refuses a changed configuration (and notes the
fields it may change), a run directory holds one run, an ``--out`` that cannot be written fails before the model is
built; a checkpoint is hashed in chunks and its tensors mapped, never read whole into memory."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sara import SimulatedEnv, UniformSampler, collect, make_allocator  # noqa: E402
from sara.config import ConfigError  # noqa: E402
from sara.driver import MIN_STEP_ROLLOUTS  # noqa: E402
from sara.envs.tasks import TASKS, make_task, register_task  # noqa: E402
from sara.train import TrainConfig, Trainer  # noqa: E402
from sara.train import checkpoint as ck  # noqa: E402
from sara.train.guards import NonFiniteTraining, StepLimitReached  # noqa: E402

TINY = {"task": "sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8", "groups_per_step": 2, "k": 2,
        "steps": 2, "eval": {"num_prompts": 4, "samples": 1, "greedy": False}, "threads": 1, "progress": False,
        "tensorboard": False, "scorer": "inline", "allocator": "sara", "checkpoint_every": 1,
        "policy_options": {"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}}}



# ------------------------------------------------------------------------------------------------ case 2
@pytest.mark.parametrize("spec", ["ds", "sara", "sara_paper:tau_low=0"])
def test_a_step_where_nothing_is_effective_stops_at_its_bound(spec):
    env = SimulatedEnv(np.zeros(400))  # always wrong: no group is ever effective
    res = collect(make_allocator(spec, k=4), env, UniformSampler(400, seed=0), target_groups=4, seed=0)
    s = res.stats
    stops = {"max_step_rollouts", "allocator_done"} if spec == "ds" else {"max_step_rollouts"}  # ds: max_gen_batches
    assert s.stop_reason in stops and s.rollouts <= MIN_STEP_ROLLOUTS, (s.stop_reason, s.rollouts)
    assert s.rollouts == s.committed_rollouts + s.abandoned_rollouts + s.discarded_rollouts


def test_a_smaller_budget_binds_first_and_keeps_its_name():
    env = SimulatedEnv(np.zeros(400))
    res = collect(make_allocator("sara", k=4), env, UniformSampler(400), target_groups=4, max_rollouts=100)
    assert res.stats.stop_reason == "max_rollouts" and res.stats.rollouts <= 100
    res = collect(make_allocator("sara", k=4), env, UniformSampler(400), target_groups=4,
                  driver={"max_step_rollouts": 50})
    assert res.stats.stop_reason == "max_step_rollouts" and res.stats.rollouts <= 50


@pytest.fixture
def always_wrong():
    base = make_task("sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8")

    def verify(completion: str, **answer) -> float:
        return 0.0

    register_task("test/AlwaysWrong-v0", lambda **_: dataclasses.replace(base, id="test/AlwaysWrong-v0",
                                                                          verifier=verify), override=True)
    yield "test/AlwaysWrong-v0"
    TASKS._items.pop("test/AlwaysWrong-v0", None)


def test_the_trainer_stops_a_step_at_its_bound_before_training_on_it(always_wrong, tmp_path):
    cfg = TrainConfig(**{**TINY, "task": always_wrong, "out_dir": str(tmp_path), "driver": {"max_step_rollouts": 64}})
    with Trainer(cfg) as trainer, pytest.raises(StepLimitReached, match=r"step 1 drew \d+ rollouts") as err:
        trainer.train()
    assert "\n" not in str(err.value) and "driver.max_step_rollouts" in str(err.value)
    assert trainer.step == 0 and trainer.learner.optimizer_steps == 0


def test_non_finite_weights_stop_the_run_before_they_reach_the_generator(tmp_path):
    cfg = TrainConfig(**{**TINY, "out_dir": str(tmp_path), "allocator": "uniform"})
    with Trainer(cfg) as trainer:
        real = trainer.learner.update
        pushed = []

        def poisoned(*args, **kwargs):
            out = real(*args, **kwargs)
            with torch.no_grad():
                next(iter(trainer.policy.parameters())).fill_(float("nan"))  # what optim.lr far too large does
            return out

        trainer.learner.update = poisoned
        trainer.backend.update_weights = lambda state, version: pushed.append(version)
        with pytest.raises(NonFiniteTraining, match="step 1: 1 weight tensors hold nan or inf") as err:
            trainer.train()
    assert "\n" not in str(err.value) and "optim.lr" in str(err.value)
    assert pushed == [] and ck.list_checkpoints(tmp_path / "checkpoints") == []


# ------------------------------------------------------------------------------------------------ case 5
@pytest.fixture(scope="module")
def one_step(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "run"
    with Trainer(TrainConfig(**{**TINY, "steps": 1, "out_dir": str(out)})) as t:
        t.train()
    return out


@pytest.mark.parametrize(("field", "value", "where"), [
    ("allocator", "sara_paper:tau_low=0.3", "allocator"), ("k", 4, "k"), ("algo", "rloo", "algo"),
    ("task", "sara/Arithmetic-v0:max_digits=2,pool_size=40,eval_size=8", "task"),
    ("optim", {"lr": 1e-3}, "optim.lr"), ("seed", 3, "seed"),
])
def test_resume_refuses_a_changed_configuration(one_step, field, value, where):
    cfg = TrainConfig(**{**TINY, "steps": 2, "out_dir": str(one_step), field: value})
    with pytest.raises(ConfigError, match=rf"--resume: field '{where}' is .* but checkpoint .* was written") as err:
        Trainer(cfg, resume=True)
    assert "\n" not in str(err.value)
    with Trainer(TrainConfig(**{**TINY, "steps": 1, "out_dir": str(one_step)}), resume=True):
        pass  # the refused resume kept no lock on the directory


def test_resume_notes_the_fields_it_may_change(one_step, capsys):
    capsys.readouterr()
    with Trainer(TrainConfig(**{**TINY, "steps": 1, "eval": {"num_prompts": 2, "samples": 1, "greedy": False},
                                "out_dir": str(one_step)}), resume=True) as t:
        assert t.step == 1
    err = capsys.readouterr().err
    assert "sara: note: --resume: field 'eval.num_prompts' changed from 4 to 2" in err


def test_resume_notes_a_changed_micro_batch_budget_and_still_refuses_the_rest_of_optim(one_step, capsys):
    """The micro-batch budget splits the same update into forwards (``resume.SPLITS``): a run checkpointed under one
    budget resumes under another with a note; a change elsewhere in ``optim`` is refused all the same."""
    capsys.readouterr()
    with Trainer(TrainConfig(**{**TINY, "steps": 1, "optim": {"microbatch_tokens": 64}, "out_dir": str(one_step)}),
                 resume=True) as t:
        assert t.step == 1
    assert "field 'optim.microbatch_tokens' changed from 'auto' to 64" in capsys.readouterr().err
    cfg = TrainConfig(**{**TINY, "steps": 2, "optim": {"microbatch_tokens": 64, "lr": 1e-3}, "out_dir": str(one_step)})
    with pytest.raises(ConfigError, match=r"--resume: field 'optim.lr' is"):
        Trainer(cfg, resume=True)


def test_cli_resume_with_a_changed_allocator_is_one_line(one_step, tmp_path, run_cli):
    import yaml

    (tmp_path / "run.yaml").write_text(yaml.safe_dump({**TINY, "steps": 2}))
    rc, err = run_cli(["train", "--resume", "--config", str(tmp_path / "run.yaml"), "--out", str(one_step),
                    "--set", "allocator=sara_paper:tau_low=0.3"])
    assert rc == 2 and err[-1].startswith("sara: error: ") and "field 'allocator'" in err[-1], err


# ------------------------------------------------------------------------------------------------ case 6
def test_a_run_directory_holds_one_run(tmp_path):
    cfg = TrainConfig(**{**TINY, "out_dir": str(tmp_path)})
    with Trainer(cfg):
        with pytest.raises(ConfigError, match=r"is in use by another sara run \(pid \d+\)") as err:
            Trainer(cfg)
        assert "\n" not in str(err.value)
    with Trainer(cfg):  # released on close
        pass


# ------------------------------------------------------------------------------------------------ case 8
@pytest.mark.parametrize("out", ["/proc/x", "/dev/null/x"])
def test_an_unusable_out_is_one_line_before_the_model_is_built(out, monkeypatch, run_cli):
    from sara.policies import POLICIES

    monkeypatch.setattr(POLICIES, "factory", lambda *a, **k: pytest.fail("the policy was built"))
    rc, err = run_cli(["train", "--out", out, "--quiet"])
    assert rc == 2 and err[-1].startswith("sara: error: train config: field 'out_dir'"), err
    assert "cannot be used as a run directory" in err[-1] and "Traceback" not in "\n".join(err)


# ------------------------------------------------------------------------------------------------ case 13
def test_a_checkpoint_is_hashed_in_chunks_and_its_tensors_mapped(tmp_path, monkeypatch):
    path = ck.checkpoint_path(tmp_path, 1)
    ck.save_checkpoint({"w": torch.ones(1000), "step": 1}, path)
    seen = []
    real_load = torch.load
    monkeypatch.setattr(type(path), "read_bytes", lambda self: pytest.fail("read the whole file"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k.get("mmap")) or real_load(*a, **k))
    state = ck.load_checkpoint(path)
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(1000)) and seen == [True]
