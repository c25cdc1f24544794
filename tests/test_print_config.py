"""``sara train --print-config`` shows the run it would train: the allocator and the sampler with every option as the
run builds them (``auto`` / None defaults resolved, ``sara.train.resolve``), no Ray section while Ray is off, and YAML
that loads back as the same ``TrainConfig``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sara.allocators import ALLOCATORS
from sara.cli import main
from sara.samplers import SAMPLERS
from sara.train import TrainConfig, load_config
from sara.train.resolve import allocation_config, config_yaml, resolved_allocation

REPO = Path(__file__).resolve().parents[1]
REASON = REPO / "examples" / "configs" / "smollm2_reason.yaml"


def _printed(capsys, *argv: str) -> str:
    assert main(["train", *argv, "--print-config"]) == 0
    return capsys.readouterr().out


def _comment_block(text: str, key: str) -> dict[str, object]:
    """The resolved options printed as comments under the top-level ``key`` (an indented block, the allocator's
    ``internals``, as a nested dict)."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
    out: dict[str, object] = {}
    block: dict[str, object] | None = None
    for line in lines[at + 2:]:
        if not line.startswith("#     "):
            break
        nested = line.startswith("#       ")
        name, _, value = line[8 if nested else 6:].partition(": ")
        if nested:
            assert block is not None, line
            block[name] = value
        elif name.endswith(":") and not value:
            block = out[name[:-1]] = {}
        else:
            block = None
            out[name] = value
    return out


def _agrees(shown: dict[str, object], built: dict[str, object]) -> None:
    """Each option shown is the built one's value, or a string that resolves it: ``"<value> (why)"`` (``auto``, an
    unused option, a ``group_by`` list), or ``"<what it resolves to> (why)"`` for a None default; a mapping
    (``internals``) option by option."""
    for key, value in built.items():
        got = shown[key]
        if isinstance(value, dict):
            assert isinstance(got, dict) and list(got) == list(value), (key, got, value)
            _agrees(got, value)
            continue
        assert got == value or (isinstance(got, str) and got.endswith(")") and (
            value is None or got.startswith(f"{value} ("))), (key, got, value)


@pytest.mark.parametrize("name", ALLOCATORS.names())
@pytest.mark.parametrize("sampler", SAMPLERS.names())
def test_every_option_of_every_allocator_and_sampler_is_shown_resolved(name, sampler):
    cfg = TrainConfig(allocator=name, sampler=sampler, k=4)
    resolved = resolved_allocation(cfg)
    config, shown = allocation_config(cfg), resolved["allocator"]
    assert shown["name"] == name and shown["k"] == 4
    user = [field for field in type(config).model_fields if field != "internals"]
    assert list(shown) == ["name", *user, "internals"]  # every option: the user's in the config's order, internals last
    assert list(shown["internals"]) == list(type(config).internals_model().model_fields)
    _agrees(shown, config.model_dump(mode="json"))
    assert "auto" not in shown.values() and shown.get("oversample", 1.0) != "auto"
    if "oversample" in shown:
        assert "expected commits" in str(shown["oversample"])
    if "prior" in shown:
        assert shown["prior"] is not None
    assert resolved["sampler"]["name"] == sampler
    assert None not in resolved["sampler"].values() and "auto" not in resolved["sampler"].values()
    text = config_yaml(cfg)
    assert _comment_block(text, "allocator")["name"] == name
    assert list(_comment_block(text, "allocator")) == list(shown)
    assert _comment_block(text, "sampler")["name"] == sampler


@pytest.mark.parametrize(("spec", "option", "value"), [
    ("sara:oversample=2,audit=0.1", "oversample", 2.0), ("sara:oversample=2,audit=0.1", "internals.audit", 0.1),
    ("sara_paper:tau_low=0.3", "tau_low", 0.3), ("ds:gen_batch_prompts=12", "gen_batch_prompts", 12),
    ("sara:prior=history,decay=0.9", "internals.decay", 0.9), ("sara:reweight=ds", "reweight", "ds"),
    ("sara:probe=2/1", "internals.probe", [2, 1]), ("ds:eps=0.01", "internals.eps", 0.01),
])
def test_an_option_given_in_the_spec_is_shown_with_its_value(spec, option, value):
    shown = resolved_allocation(TrainConfig(allocator=spec))["allocator"]
    for part in option.split("."):
        shown = shown[part]
    assert shown == value


def test_the_allocator_block_shows_the_users_options_first_then_the_internals_resolved():
    text = config_yaml(TrainConfig(allocator="sara"))
    lines = text.splitlines()
    at = lines.index("#     internals:")
    assert lines[at - 1].startswith("#     reweight: ") and lines[at + 1] == "#       eps: 1.0e-06"
    block = _comment_block(text, "allocator")
    assert list(block) == ["name", "k", "completion", "oversample", "prior", "group_by", "reweight", "internals"]
    inner = block["internals"]
    assert list(inner) == ["eps", "probe", "alpha0", "beta0", "decay", "max_evidence", "audit", "audit_seed",
                           "max_weight", "drain"]
    assert inner["decay"] == "auto (unused, the prior is empirical)" and inner["audit"] == "0.04"
    history = _comment_block(config_yaml(TrainConfig(allocator="sara:prior=history,audit=0")), "allocator")
    assert history["internals"]["decay"].startswith("auto (chosen online") and history["internals"]["audit"] == "0.0"


def test_the_prior_shown_is_the_one_the_run_reads():
    def prior(allocator: str, sampler: str) -> str:
        return str(resolved_allocation(TrainConfig(allocator=allocator, sampler=sampler))["allocator"]["prior"])

    assert prior("sara", "uniform") == "empirical (the rule's default)"
    assert prior("sara_paper", "uniform") == "constant (the rule's default)"
    assert prior("sara", "predictive").startswith("history (the sampler's")  # borrowed, as compose lends it
    assert prior("sara:prior=constant", "predictive") == "constant"  # a prior given is kept
    assert prior("sara_continuous", "predictive") == "constant (the rule's default)"  # borrows no history
    shown = resolved_allocation(TrainConfig(allocator="sara", sampler="predictive:population=allocator"))
    assert "unused" in str(shown["allocator"]["internals"]["decay"])
    assert shown["sampler"]["decay"].startswith("auto (chosen online")
    assert shown["sampler"]["population"].startswith("allocator (sara's grid population")
    assert "lends no population" in resolved_allocation(TrainConfig(allocator="ds", sampler="predictive"))[
        "sampler"]["population"]


def test_pool_dependent_defaults_name_what_they_come_from():
    shown = resolved_allocation(TrainConfig())["allocator"]
    assert shown["group_by"].startswith("component|<embedding> (by the metadata key component if the pool's")
    assert shown["reweight"].startswith("none under component, ds under <embedding>")
    one = resolved_allocation(TrainConfig(allocator="sara:group_by=none"))["allocator"]
    assert one["group_by"] == "none (one population)" and one["reweight"].startswith("none (one population")


def test_print_config_shows_the_allocator_and_sampler_and_no_ray_section_while_ray_is_off(capsys):
    text = _printed(capsys, "--config", str(REASON))
    allocator = _comment_block(text, "allocator")
    assert allocator["name"] == "sara" and allocator["k"] == "8" and allocator["prior"].startswith("empirical")
    assert allocator["oversample"].startswith("auto (fresh units until the expected commits")
    assert _comment_block(text, "sampler") == {"name": "uniform", "pool_epochs": "unlimited (null)"}
    assert "ray" not in yaml.safe_load(text) and "\nray:" not in text
    on = _printed(capsys, "--config", str(REASON), "--ray", "--num-workers", "3")
    assert yaml.safe_load(on)["ray"]["enabled"] is True and yaml.safe_load(on)["ray"]["num_workers"] == 3


def test_an_invalid_allocator_option_is_refused_by_print_config_as_by_the_run(capsys):
    assert main(["train", "--set", "allocator=sara:oversample=0.5", "--print-config"]) == 2
    assert "oversample" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    [], ["--config", str(REASON)], ["--set", "sampler=predictive:decay=0.9"], ["--ray", "--num-workers", "3"],
    ["--set", "allocator=sara:prior=history,group_by=level|auto,oversample=2"], ["--driver", "stream"],
    ["--set", "allocator=ds", "--set", "sampler=uniform:pool_epochs=2", "--set", "k=4"],
])
def test_the_printed_config_loads_back_as_the_same_run(argv, capsys, tmp_path):
    text = _printed(capsys, *argv)
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    cfg = load_config(path)
    assert config_yaml(cfg) + "\n" in text  # printing what was printed prints it again
    assert _printed(capsys, "--config", str(path)) == text
    overrides = [a for flag, a in zip(argv, argv[1:]) if flag == "--set"]
    given = load_config(argv[argv.index("--config") + 1] if "--config" in argv else None, overrides)
    same = {"name", "ray", "driver"} if "--ray" in argv or "--driver" in argv else {"name"}  # what flags set
    assert cfg.model_dump(exclude=same) == given.model_dump(exclude=same)


def test_ray_options_while_ray_is_off_are_left_out_and_change_nothing(tmp_path):
    cfg = load_config(overrides=["ray.num_workers=5"])
    path = tmp_path / "printed.yaml"
    path.write_text(config_yaml(cfg))
    back = load_config(path)
    assert not back.ray.enabled and back.model_dump(exclude={"ray"}) == cfg.model_dump(exclude={"ray"})
    on = cfg.model_copy(update={"ray": cfg.ray.model_copy(update={"enabled": True})})
    path.write_text(config_yaml(on))
    assert load_config(path) == on


def test_the_trainer_builds_what_is_printed(tmp_path):
    pytest.importorskip("torch")
    from sara.train import Trainer

    cfg = TrainConfig(task="sara/Arithmetic-v0:max_digits=1,pool_size=40,eval_size=8", allocator="sara:audit=0.1",
                      sampler="predictive", k=4, groups_per_step=2, steps=1, threads=1, progress=False,
                      tensorboard=False, out_dir=str(tmp_path), eval={"num_prompts": 2, "samples": 1, "greedy": False},
                      policy_options={"d_model": 16, "n_layers": 1, "n_heads": 2, "warm_start": {"steps": 0}})
    shown = resolved_allocation(cfg)
    with Trainer(cfg) as trainer:
        _agrees(shown["allocator"], trainer.allocator.config.model_dump(mode="json"))
        assert trainer.allocator.prior_kind == "history" and shown["allocator"]["prior"].startswith("history")
        assert trainer.sampler.config.model_dump(mode="json")["k"] == shown["sampler"]["k"] == 4
