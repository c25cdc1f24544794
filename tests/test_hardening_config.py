"""Config text and CLI values: strings stay strings (``--out``, names, spec strings), YAML 1.2 scalars, duplicate keys
and alias bombs refused, non-UTF-8 files and degenerate numbers are one-line errors naming the field."""

from __future__ import annotations

import math
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sara.cli import main
from sara.config import ConfigError
from sara.configfile import MAX_NODES, load_yaml, parse_value
from sara.train.config import TrainConfig, apply_overrides, load_config

BOMB = """ray:
  runtime_env:
    a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
    b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
    c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
    d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
    e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
    f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
    g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
    h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
    i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def _cli(argv: list[str], capsys) -> tuple[int, str, list[str]]:
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.splitlines() if line.strip()]


@pytest.mark.parametrize("out", ["#exp1", "~", "null", "runs/a #1", "none", "[1]", "{a: 1}", "12:30", "'q'", "x\ty"])
def test_out_is_taken_literally(out, capsys):
    rc, text, err = _cli(["train", "--out", out, "--print-config"], capsys)
    assert rc == 0, err
    assert yaml.safe_load(text)["out_dir"] == out
    assert str(load_config(values={"out_dir": out}).output_dir) == out.rstrip("/")


@pytest.mark.parametrize(("item", "field", "value"), [
    ("name=12:30", "name", "12:30"), ("name=a #1", "name", "a #1"), ("name=yes", "name", "yes"),
    ("name=010", "name", "010"), ("out_dir=#x", "out_dir", "#x"), ("out_dir=null", "out_dir", None),
    ("seed=010", "seed", 10), ("k=0x10", "k", 16), ("eval.by=null", "eval.by", None),
    ("eval.by=level", "eval.by", "level"), ("ray.address=ray://h:10001 #x", "ray.address", "ray://h:10001 #x"),
    ("optim.lr=3e-4", "optim.lr", 3e-4), ("progress=false", "progress", False),
])
def test_set_values_keep_their_meaning(item, field, value):
    cfg = load_config(overrides=[item])
    got = cfg
    for part in field.split("."):
        got = getattr(got, part)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(("item", "field"), [
    ("optim.lr=inf", "optim.lr"), ("optim.lr=.inf", "optim.lr"), ("optim.lr=1e30", "optim.lr"),
    ("optim.lr=nan", "optim.lr"), ("optim.weight_decay=inf", "optim.weight_decay"),
    ("optim.betas=[nan, 0.9]", "optim.betas"), ("optim.betas=[2, 3]", "optim.betas"),
    ("temperature=inf", "temperature"), ("temperature=1e9", "temperature"), ("max_new_tokens=1e9", "max_new_tokens"),
    ("optim.grad_clip=inf", "optim.grad_clip"), ("max_verifier_failure_share=nan", "max_verifier_failure_share"),
    ("name=", "name"), ("name=/etc", "name"), ("name=../up", "name"), ("out_dir=", "out_dir"),
])
def test_degenerate_values_are_one_line_errors_naming_the_field(item, field, capsys):
    rc, _, err = _cli(["train", "--set", item, "--print-config"], capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("sara: error: "), err
    assert f"field '{field}" in err[0], err


@pytest.mark.parametrize(("item", "field", "option"), [
    ("allocator=sara:eps=-1", "allocator", "eps"), ("allocator=ds:max_oversample=0", "allocator", "max_oversample"),
    ("allocator=sara:nosuch=1", "allocator", "nosuch"), ("sampler=predictive:explore=7", "sampler", "explore"),
    ("allocator=nosuch", "allocator", "nosuch"),
])
def test_allocator_and_sampler_options_are_checked_with_the_config(item, field, option):
    """A bad allocator or sampler option fails when the config is made (as --print-config and before any model
    loads), naming the config's field and the option."""
    with pytest.raises(ConfigError, match=f"field '{field}': .*{option}"):
        load_config(None, [item])


def test_an_alias_bomb_is_refused_at_once(tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    t0 = time.perf_counter()
    rc, _, err = _cli(["train", "--config", str(path), "--print-config"], capsys)
    assert rc == 2 and len(err) == 1 and f"expands to more than {MAX_NODES:,} values" in err[0], err
    assert time.perf_counter() - t0 < 30  # generous: it is a walk of at most MAX_NODES values
    with pytest.raises(ConfigError, match="expands to more"):
        apply_overrides({}, ["policy_options={a: &a [1,1,1,1,1,1,1,1,1,1], b: [" + ",".join(["*a"] * 20000) + "]}"],
                        model=TrainConfig)


@pytest.mark.parametrize(("text", "needle"), [
    ("k: 4\nk: 8\n", "key 'k' is given twice"), ("optim: {lr: 1e-4, lr: 2e-4}\n", "key 'lr' is given twice"),
    ("[" * 5000 + "]" * 5000, "nested more than"), ("k: [1\n", "not valid YAML at line"), ("- 1\n", "a mapping"),
])
def test_config_files_that_are_not_what_they_seem(tmp_path, capsys, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    rc, _, err = _cli(["train", "--config", str(path), "--print-config"], capsys)
    assert rc == 2 and len(err) == 1 and needle in err[0], err


def test_a_merge_key_may_still_be_overridden():
    assert load_yaml("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n", what="c")["b"] == {"x": 3, "y": 2}


def test_non_utf8_config_is_one_line(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    rc, _, err = _cli(["train", "--config", str(path), "--print-config"], capsys)
    assert rc == 2 and len(err) == 1 and "not UTF-8" in err[0], err


# ---------------------------------------------------------------------------------------------- properties
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=24)


@settings(max_examples=150, derandomize=True, deadline=None, database=None)
@given(value=TEXT)
def test_string_fields_keep_any_text(value):
    """``--set name=V`` / ``--out V`` / a spec string: the field holds exactly V, or it is a one-line error naming
    the field (a run name that is empty, absolute or climbs out of runs/)."""
    try:
        cfg = load_config(overrides=[f"name={value}"], values={"out_dir": value})
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg and ("field 'name'" in msg or "field 'out_dir'" in msg), msg
        return
    assert cfg.name == value and cfg.out_dir == value
    spec = apply_overrides({}, [f"task={value}", f"allocator={value}"], model=TrainConfig)
    assert spec == {"task": value, "allocator": value}


NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**30, 10**30),
                    st.sampled_from(["inf", "-inf", ".inf", ".nan", "nan", "1e309", "1e-400", "0x1p3", "1_0",
                                     "12:30", "yes", "010", "--1", "1e", ""]))
NUMERIC = ["optim.lr", "optim.weight_decay", "optim.grad_clip", "temperature", "max_new_tokens", "k", "seed",
           "groups_per_step", "max_verifier_failure_share", "driver.max_step_rollouts", "eval.samples"]


@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(NUMERIC), value=NUMBERS)
def test_numeric_fields_are_finite_in_range_or_one_line_errors(field, value):
    raw = repr(value) if isinstance(value, float) else str(value)
    try:
        cfg = load_config(overrides=[f"{field}={raw}"])
    except ConfigError as exc:
        msg = str(exc)
        assert "\n" not in msg and f"field '{field}'" in msg, (raw, msg)
        return
    got = cfg
    for part in field.split("."):
        got = getattr(got, part)
    assert got is None or (isinstance(got, (int, float)) and math.isfinite(got)), (raw, got)
    parsed = parse_value(raw, what="x")
    if isinstance(parsed, (int, float)) and not isinstance(parsed, bool) and got is not None:
        assert got == parsed, (raw, got, parsed)  # a value is taken as written, or refused
