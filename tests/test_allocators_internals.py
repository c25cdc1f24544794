"""An allocator's config: the top-level fields are what a user decides, ``internals`` holds the research knobs and
constants. A spec gives both flat (``sara:audit=0``), and a flat key builds the same config as the nested form."""

from __future__ import annotations

import pytest

from sara.allocators import ALLOCATORS, SARAAllocator, SARAConfig, choose_allocator, make_allocator
from sara.allocators.paper import SARAPaperConfig
from sara.config import ConfigError, validate_config

# a valid value other than the default for every internals field: (as a spec gives it, as the config holds it)
VALUES: dict[str, tuple[str, object]] = {
    "eps": ("0.01", 0.01), "probe": ("2/1", (2, 1)), "alpha0": ("0.5", 0.5), "beta0": ("2", 2.0),
    "decay": ("0.9", 0.9), "max_evidence": ("8", 8.0), "audit": ("0.1", 0.1), "audit_seed": ("3", 3),
    "max_weight": ("3", 3.0), "drain": ("false", False),
}
CASES = [(name, field) for name in ALLOCATORS.names()
         for field in ALLOCATORS.get(name).Config.internals_model().model_fields]


def test_every_internals_field_has_a_value_here():
    assert {field for _, field in CASES} <= set(VALUES)


@pytest.mark.parametrize(("name", "field"), CASES)
def test_a_flat_spec_key_builds_the_config_its_nested_form_builds(name, field):
    cls = ALLOCATORS.get(name)
    flat, value = VALUES[field]
    from_spec = choose_allocator(f"{name}:{field}={flat}", k=8).config
    nested = validate_config(cls.Config, {"k": 8, "internals": {field: value}}, what=name)
    assert from_spec == nested and getattr(from_spec.internals, field) == value
    assert from_spec != validate_config(cls.Config, {"k": 8}, what=name)  # the value was not the default
    assert cls.Config.model_validate({"k": 8, field: value}) == nested  # flat keyword data, as SARAConfig(audit=0)
    assert cls.Config.model_validate(nested.model_dump()) == nested  # state_dict's nested form
    assert cls.Config.model_validate(nested.spec_options()) == nested  # a checkpoint's flat config loads too
    assert field not in cls.Config.model_fields and field in cls.Config.option_names()


def test_sara_exposes_what_a_user_decides_and_keeps_the_rest_internal():
    assert set(SARAConfig.model_fields) == {"k", "prior", "group_by", "reweight", "completion", "oversample",
                                            "internals"}
    assert set(SARAConfig.internals_model().model_fields) == {
        "eps", "probe", "alpha0", "beta0", "decay", "max_evidence", "audit", "audit_seed", "max_weight", "drain"}
    assert set(SARAPaperConfig.model_fields) == {"k", "tau_low", "tau_high", "prior", "completion", "oversample",
                                                 "internals"}
    assert set(ALLOCATORS.get("ds").Config.internals_model().model_fields) == {"eps"}


def test_a_key_given_flat_and_nested_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="'audit' given both flat and under 'internals'") as err:
        SARAAllocator({"audit": 0.0, "internals": {"audit": 0.1}})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="'eps'"):
        SARAConfig(eps=0.1, internals=SARAConfig().internals.model_copy(update={"eps": 0.2}))
    merged = SARAConfig(audit=0.0, internals={"drain": False})  # different keys merge
    assert merged.internals.audit == 0.0 and merged.internals.drain is False


@pytest.mark.parametrize(("spec", "says"), [
    ("sara:bogus=1", "field 'bogus': unknown option; known options: alpha0, audit, audit_seed"),
    ("sara:eps=-1", "field 'eps': Input should be greater than or equal to 0"),
    ("sara:probe=0", "field 'probe': every probe entry must be an integer >= 1"),
    ("sara:tau_low=0.3", "field 'tau_low': an option of 'sara_paper', not of this rule; use 'sara_paper:tau_low=0.3'"),
    ("sara_paper:audit=0", "field 'audit': an option of 'sara', not of this rule; use 'sara:audit=0'"),
    ("ds:probe=2", "field 'probe': unknown option"),
])
def test_a_bad_key_is_one_line_naming_it_flat(spec, says):
    with pytest.raises(ConfigError) as err:
        make_allocator(spec, k=8)
    assert says in str(err.value) and "\n" not in str(err.value) and "internals." not in str(err.value)


def test_an_unknown_nested_key_is_named_too():
    with pytest.raises(ConfigError, match="field 'bogus': unknown option"):
        SARAAllocator({"internals": {"bogus": 1}})


def test_overrides_and_repr_are_flat():
    a = SARAAllocator(SARAConfig(probe="2/1"), audit=0.0, internals={"drain": False})
    assert a.config.internals.probe == (2, 1) and a.config.internals.audit == 0.0 and not a.config.internals.drain
    assert a.eps == a.config.internals.eps == 1e-6
    text = repr(a)
    assert "probe=2/1" in text and "audit=0.0" in text and "drain=False" in text and "internals" not in text
    assert text.index("reweight=") < text.index("eps=")  # the user's options first
