"""Every command's ``--help``: plain text (no reStructuredText markup), each default printed once, every option
documented, a description on every subcommand; ``sara --version`` and ``-V``; the top-level and ``sara bench`` help
name every subcommand; ``--json FILE`` on every command that reports numbers; an unknown option shows its
subcommand's usage; an error is one bounded line."""

from __future__ import annotations

import argparse
import re

import pytest

from sara import __version__
from sara.cli import MAX_ERROR_CHARS, HelpFormatter, build_parser, main, parsers, plain

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
    assert "(default: runs/<name>, the config's name or one made of the algorithm, allocator, sampler" in text
    assert "sara train --print-config" in text and "docs/training.md" in text  # where the --set keys are


def test_version_short_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["-V"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"sara {__version__}"


@pytest.mark.parametrize("path", [p for p in PATHS if p != "sara"])
def test_every_subcommand_has_a_description(path):
    parser = dict(parsers(build_parser()))[path]
    assert parser.description and parser.description.strip(), path
    text = " ".join(_help(path).split())
    assert " ".join(plain(parser.description).split())[:40] in text


LEAVES = [path for path, p in parsers(build_parser())
          if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions) and path != "sara"]


@pytest.mark.parametrize("path", LEAVES)
def test_every_command_that_reports_numbers_writes_json(path):
    options = {o for a in dict(parsers(build_parser()))[path]._actions for o in a.option_strings}
    assert ("--json" in options) == (path != "sara model prepare"), path  # model prepare reports a path only


@pytest.mark.parametrize("argv", [["train", "--bogus"], ["bench", "allocation", "--zz", "1"], ["matrix", "-x"],
                                  ["bench", "ray", "scaling", "--nope"]])
def test_an_unknown_option_shows_its_subcommands_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    command = " ".join(a for a in argv if not a.startswith("-") and not a.isdigit())
    assert exc.value.code == 2 and err.startswith(f"usage: sara {command} "), err
    assert f"sara {command}: error: unrecognized arguments: " in err


def test_an_error_message_is_one_bounded_line(monkeypatch, capsys):
    import sara.commands.train as train_command
    from sara.config import ConfigError

    def fail(args):
        raise ConfigError("field 'task': " + "x" * 200_000)

    monkeypatch.setattr(train_command, "run", fail)
    assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sara: error: field 'task': xxx") and err.count("\n") == 1
    assert len(err) < MAX_ERROR_CHARS + 100 and "more characters" in err


def test_a_keyboard_interrupt_ends_the_command_with_one_line(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    args = build_parser().parse_args(["train"])
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", lambda self, argv=None: (
        argparse.Namespace(**{**vars(args), "func": interrupted}), []))
    assert main(["train"]) == 130
    assert capsys.readouterr().err.strip() == "sara: interrupted"
