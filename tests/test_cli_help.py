"""Every command's ``--help``: plain text (no reStructuredText markup), each default printed once, every option
documented; ``sara --version``; the top-level and ``sara bench`` help name every subcommand."""

from __future__ import annotations

import re

import pytest

from sara import __version__
from sara.cli import HelpFormatter, build_parser, main, parsers

PATHS = [path for path, _ in parsers(build_parser())]


def _help(path: str) -> str:
    return dict(parsers(build_parser()))[path].format_help()


def test_every_command_is_covered():
    assert {"sara train", "sara matrix", "sara bench allocation", "sara bench decisions", "sara bench soak",
            "sara bench generation", "sara bench stream", "sara bench ray scaling", "sara bench ray stream",
            "sara bench learner", "sara model prepare"} <= set(PATHS)


@pytest.mark.parametrize("path", PATHS)
def test_help_is_plain_text_with_each_default_once(path):
    text = _help(path)
    assert "``" not in text and ":func:" not in text and not re.search(r"^\s*\.\. ", text, re.M), text
    flat = " ".join(text.split())  # help lines are wrapped
    for option in re.split(r"\n(?=  -)", text)[1:]:  # one chunk per option (the first: usage, description)
        assert len(re.findall(r"\(default", option)) <= 1, option
    assert "(default: None)" not in flat and "(default: True)" not in flat and "(default: False)" not in flat


@pytest.mark.parametrize("path", PATHS)
def test_every_option_is_documented_and_every_default_shown(path):
    parser = dict(parsers(build_parser()))[path]
    assert parser.formatter_class is HelpFormatter
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{path} {action.option_strings[0]} has no help"
        shown = HelpFormatter("x")._get_help_string(action) % {"default": action.default}
        if action.default not in (None, False, True, []) and action.nargs != 0:
            assert "default" in shown, f"{path} {action.option_strings[0]}: default {action.default!r} not shown"


def test_top_level_help_names_every_subcommand():
    top = " ".join(_help("sara").split())
    for name in ("train", "matrix", "bench", "model"):
        assert f" {name} " in top
    bench = _help("sara bench")
    for name in ("allocation", "decisions", "soak", "generation", "stream", "ray", "learner"):
        assert name in bench and name in " ".join(top.split())


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"sara {__version__}"


def test_train_help_states_the_default_run_and_its_outputs():
    text = " ".join(_help("sara train").split())
    assert "about 40 s" in text and "--overwrite" in text and "tensorboard" in text
    assert "(default: runs/<name>)" in text
