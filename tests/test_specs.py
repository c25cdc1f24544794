"""``ALLOCATOR[@SAMPLER]`` is read in one place (``sara.specs.parse_allocation``): every command that takes such
specs (``sara matrix``, ``sara bench allocation``, ``sara bench ds-estimate``, ``diagnose_policy``) splits it there
and refuses a malformed one with the same one-line error before anything runs."""

from __future__ import annotations

import pytest

from sara.config import ConfigError
from sara.specs import AllocationSpec, parse_allocation, split_specs


@pytest.mark.parametrize(("text", "allocator", "sampler"), [
    ("sara", "sara", None),
    ("sara@predictive", "sara", "predictive"),
    (" sara_paper:tau_low=0.45 @ predictive:decay=0.9 ", "sara_paper:tau_low=0.45", "predictive:decay=0.9"),
    ("sara:prior=history,decay=0.95@predictive", "sara:prior=history,decay=0.95", "predictive"),
    ("ds@oracle", "ds", "oracle"),
])
def test_a_good_spec_splits_at_its_at(text, allocator, sampler):
    assert parse_allocation(text) == AllocationSpec(allocator, sampler)
    assert parse_allocation(text).sampler_or("uniform") == (sampler or "uniform")


@pytest.mark.parametrize("text", ["", "  ", "@predictive", "sara@", "sara@ ", "sara@predictive@uniform", "a@@b", "@"])
def test_a_malformed_spec_is_one_error(text):
    with pytest.raises(ConfigError) as err:
        parse_allocation(text, field="allocators", what="matrix")
    msg = str(err.value)
    assert msg.startswith(f"matrix: field 'allocators': {text!r} must look like ALLOCATOR or ALLOCATOR@SAMPLER")
    assert "\n" not in msg


def test_split_specs_keeps_options_with_their_spec():
    assert split_specs("ds,sara_paper:tau_low=0.45,probe=1") == ["ds", "sara_paper:tau_low=0.45,probe=1"]
    assert split_specs("sara@predictive; ds ;") == ["sara@predictive", "ds"]


@pytest.mark.parametrize("argv", [
    ["matrix", "--quick", "--allocators", "ds;sara@predictive@uniform"],
    ["bench", "allocation", "--allocators", "ds;sara@", "--pool-size", "50", "--seeds", "1"],
    ["bench", "ds-estimate", "--allocators", "sara@predictive@uniform"],
])
def test_every_command_refuses_a_malformed_spec_before_it_runs(tmp_path, run_cli, argv):
    rc, err = run_cli([*argv, "--json", str(tmp_path / "r.json")] if argv[0] == "bench" else
                      [*argv, "--out", str(tmp_path / "m")])
    assert rc == 2 and len(err) == 1 and "must look like ALLOCATOR or ALLOCATOR@SAMPLER" in err[0], err
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "m").exists()


def test_diagnose_reads_specs_the_same_way():
    from sara.bench.diagnose import diagnose_policy
    from sara.train import TrainConfig

    with pytest.raises(ConfigError, match=r"diagnose: field 'specs': 'sara@' must look like"):
        diagnose_policy(TrainConfig(), ["sara@"], steps=1)
