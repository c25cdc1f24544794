"""TrainConfig validation, file + override loading, and the CLI's error messages (no training here)."""

from __future__ import annotations

import pytest

from sara.cli import main
from sara.config import ConfigError
from sara.train import TrainConfig, apply_overrides, load_config


def test_defaults_are_the_embedded_run():
    cfg = TrainConfig()
    assert (cfg.algo, cfg.allocator, cfg.policy, cfg.backend) == ("grpo", "sara", "tiny", "tiny")
    assert cfg.task.startswith("sara/Mixture-v0:components=arithmetic-bands")
    assert str(cfg.output_dir) == "runs/" + cfg.name


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["k=1"], "k"),
        (["optim.lr=-1"], "optim.lr"),
        (["optim.schedule=exponential"], "optim.schedule"),
        (["eval.every=-3"], "eval.every"),
        (["groups_per_step=zero"], "groups_per_step"),
        (["no_such_field=1"], "no_such_field"),
        (["optim.bogus=1"], "optim.bogus"),
        (["temperature=0"], "temperature"),
        (["scorer=gpu"], "scorer"),
    ],
)
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        load_config(None, overrides)


def test_overrides_parse_yaml_scalars_and_nest():
    data = apply_overrides({"optim": {"lr": 1.0}}, ["optim.lr=3e-4", "k=4", "progress=false", "algo=ppo:lam=0.9"])
    assert data == {"optim": {"lr": 3e-4}, "k": 4, "progress": False, "algo": "ppo:lam=0.9"}
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["oops"])


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("algo: rloo\nk: 4\noptim:\n  lr: 0.001\n")
    cfg = load_config(f, ["k=6"])
    assert (cfg.algo, cfg.k, cfg.optim.lr) == ("rloo", 6, 1e-3)
    f.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(f)


def test_cli_reports_the_field_and_exits_2(capsys, tmp_path):
    assert main(["train", "--set", "optim.lr=-1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "optim.lr" in err
    assert main(["train", "--set", "k=4", "--print-config"]) == 0
    assert "k: 4" in capsys.readouterr().out


def test_unknown_registry_names_fail_with_the_field(tmp_path):
    pytest.importorskip("torch")
    from sara.train import Trainer

    for key, value in (("algo", "nope"), ("allocator", "nope"), ("policy", "nope"), ("backend", "nope")):
        with pytest.raises(ConfigError, match="nope"):
            Trainer({key: value, "out_dir": str(tmp_path), "policy_options": {"warm_start": {"steps": 0}}})


def test_matrix_rejects_bad_steps(capsys):
    assert main(["matrix", "--steps", "0"]) == 2
    assert "steps" in capsys.readouterr().err


def test_policy_and_backend_take_spec_strings_like_every_other_component():
    cfg = TrainConfig(policy="tiny:d_model=32", policy_options={"warm_start": {"steps": 0}}, backend="tiny")
    assert cfg.component("policy") == ("tiny", {"d_model": "32", "warm_start": {"steps": 0}})
    assert cfg.component("backend") == ("tiny", {})
    with pytest.raises(ConfigError, match="field 'policy'.*d_model.*both"):
        load_config(None, ["policy=tiny:d_model=32", "policy_options.d_model=64"])


def test_missing_and_malformed_config_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [grpo\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)
