"""examples/verl (the GPU recipe: GRPO + SARA on GSM8K) checked as far as a CPU goes (``bash .ci/verl``; skipped
without verl): the config composes with verl 0.9.1's and passes verl's validation, the names it gives load the sampler
and the manager, GSM8K rows in the recipe's format load through verl's ``RLHFDataset`` and score with verl's rule, the
worker class ships to Ray by value, and one training step's sampling runs on the recipe's config with scripted
rollouts. Not checked here: anything that needs a GPU or the model (vLLM servers, FSDP workers, the training itself).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl.trainer.ppo.v1.replay_buffer", reason="needs verl 0.9.1 (bash .ci/verl)")

from test_integrations_verl_harness import Rig, compose  # noqa: E402
from test_integrations_verl_sampler import check_step, spy_dispatch  # noqa: E402

from sara.integrations.verl import SaraAgentLoopManager, SaraSampler, VerlSamplerConfig, check_trainer_config  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "verl"
EXAMPLES = [{"question": f"Tom has {i} apples and buys {i + 3} more. How many apples does he have?",
             "answer": f"{i} + {i + 3} = {2 * i + 3}\n#### {2 * i + 3}"} for i in range(40)]


def prepare_module():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", RECIPE / "prepare_gsm8k.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_parquet(tmp_path: Path) -> tuple[Path, Path]:
    import pandas as pd

    to_row = prepare_module().to_row
    paths = []
    for split, rows in (("train", EXAMPLES[:32]), ("test", EXAMPLES[32:])):
        path = tmp_path / f"{split}.parquet"
        pd.DataFrame([to_row(ex, i, split) for i, ex in enumerate(rows)]).to_parquet(path)
        paths.append(path)
    return paths[0], paths[1]


def recipe_config(tmp_path: Path, extra: tuple[str, ...] = ()):
    train, test = write_parquet(tmp_path)
    return compose(str(RECIPE), "sara_grpo_gsm8k", [f"data.train_files={train}", f"data.val_files={test}", *extra])


def tiny_tokenizer():
    """A word-level tokenizer with a chat template (RLHFDataset measures prompts with it); no model needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "[PAD]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    hf.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    return hf


def test_the_recipe_composes_validates_and_names_the_adapter(tmp_path):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.import_utils import load_class_from_fqn, load_module

    cfg = recipe_config(tmp_path)
    OmegaConf.resolve(cfg)
    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "sync" and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.gen_batch_size == 1 and cfg.actor_rollout_ref.rollout.n == 8
    check_trainer_config(cfg)
    opts = VerlSamplerConfig.model_validate(OmegaConf.to_container(cfg.trainer.v1.sampler.sampler_kwargs))
    assert opts.allocator == "sara" and opts.sampler == "verl"
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    fqn = rollout.agent.agent_loop_manager_class
    assert load_class_from_fqn(fqn, "AgentLoopManager") is SaraAgentLoopManager
    custom = cfg.trainer.v1.sampler.custom_sampler
    assert getattr(load_module(custom.path), custom.name) is SaraSampler


def test_the_run_script_runs_the_recipe():
    script = RECIPE / "run_qwen2_5_gsm8k.sh"
    text = script.read_text()
    assert "verl.trainer.main_ppo" in text and "--config-name=sara_grpo_gsm8k" in text and '--config-path="$HERE"' in text
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_gsm8k_rows_load_in_verls_dataset_and_score_with_its_rule(tmp_path):
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.reward_score import default_compute_score

    cfg = recipe_config(tmp_path)
    ds = create_rl_dataset(cfg.data.train_files, cfg.data, tiny_tokenizer(), None, is_train=True)
    assert len(ds) == 32  # none filtered as overlong
    row = ds[5]
    assert row["index"] == 5 and row["raw_prompt"][0]["content"].startswith("Tom has 5 apples")
    truth = row["reward_model"]["ground_truth"]
    assert truth == "13"
    assert default_compute_score(row["data_source"], "5 + 8 = 13\n#### 13", truth) == 1.0
    assert default_compute_score(row["data_source"], "#### 12", truth) == 0.0


def test_the_worker_class_ships_to_ray_by_value():
    import ray
    import ray.cloudpickle as cloudpickle

    from sara.integrations.verl_agent_loop import worker_class

    assert isinstance(ray.remote(worker_class()), ray.actor.ActorClass)
    code = ("import sys, ray.cloudpickle as cp; cls = cp.loads(sys.stdin.buffer.read()); "
            "print(','.join(c.__name__ for c in cls.__mro__[:3]))")
    out = subprocess.run([sys.executable, "-c", code], input=cloudpickle.dumps(worker_class()), capture_output=True,
                         check=True)
    assert out.stdout.decode().strip() == "SaraAgentLoopWorker,SaraWorkerMixin,AgentLoopWorkerTQ"


def test_one_step_of_the_recipe_with_scripted_rollouts(tmp_path):
    from verl.trainer.ppo.utils import create_rl_dataset

    cfg = recipe_config(tmp_path, ("data.train_batch_size=4", "trainer.v1.sampler.sampler_kwargs.max_inflight_rollouts=32",
                                   "trainer.v1.sampler.sampler_kwargs.max_rollouts_per_step=256"))
    ds = create_rl_dataset(cfg.data.train_files, cfg.data, tiny_tokenizer(), None, is_train=True)
    rig = Rig(cfg, dataset=ds)
    dispatched = spy_dispatch(rig)
    try:
        rep = rig.step(1)
        check_step(rig, rep, dispatched)
        assert rep["result"].stats.committed_groups >= 4
    finally:
        rig.close()


def test_create_builds_the_sara_workers_with_verls_own_worker_setup(tmp_path, monkeypatch):
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

    from sara.config import ConfigError
    from sara.integrations.verl_agent_loop import worker_class

    seen = {}

    async def init_workers(self):  # the Ray actors need a tokenizer and LLM servers: the class boundary
        seen["cls"] = self.agent_loop_workers_class
        self.agent_loop_workers = ["worker-0", "worker-1"]

    monkeypatch.setattr(AgentLoopManagerTQ, "_init_agent_loop_workers", init_workers)
    cfg = recipe_config(tmp_path)
    manager = SaraAgentLoopManager.create(config=cfg, llm_client=None, teacher_client=None,
                                          reward_loop_worker_handles=None)
    assert manager.workers == ["worker-0", "worker-1"]
    assert seen["cls"].__ray_actor_class__ is worker_class()
    cfg.trainer.v1.sampler.custom_sampler.name = "ReplayBuffer"
    with pytest.raises(ConfigError, match="SaraSampler"):
        SaraAgentLoopManager.create(config=cfg, llm_client=None)
