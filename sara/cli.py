"""The ``sara`` command line: ``sara <command> [<subcommand>] [options]``.

Each command lives in its own module under ``sara.commands`` exposing ``register(subparsers)``; the module adds its
parser(s) and sets ``func`` (called with the parsed args, returns an exit code). ``build_parser`` then gives every
parser the same help style (``HelpFormatter``): plain text, each default printed once, and a description (its
one-line help when the command gives none). An unknown option is reported with the usage of the (sub)command it
was given to, and an error message is one bounded line (``MAX_ERROR_CHARS``).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import textwrap
from collections.abc import Iterator, Sequence

# Modules under sara.commands, in help order. Add a command by adding a module here.
COMMANDS: tuple[str, ...] = ("train", "matrix", "bench", "model")

_RST = re.compile(r"``(.+?)``")
MAX_ERROR_CHARS = 2000
"""An error message longer than this is cut (``sara.registry.clip``): one line a person can read."""


def plain(text: str) -> str:
    """``text`` without reStructuredText inline literals (````x```` becomes ``x``)."""
    return _RST.sub(r"\1", text)


class HelpFormatter(argparse.HelpFormatter):
    """Plain-text help: paragraphs of a description kept (and refilled), RST literals dropped, and an option's
    default appended once, as ``(default: X)``, unless its help already names one or it has none to show
    (``None``, a flag's ``False`` / ``True``, an empty list)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = re.split(r"\n\s*\n", textwrap.dedent(plain(text)).strip())
        return "\n\n".join(textwrap.fill(" ".join(p.split()), width, initial_indent=indent,
                                         subsequent_indent=indent) for p in paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = plain(action.help or "")
        default = action.default
        if ("default" in text or not action.option_strings or default in (None, argparse.SUPPRESS, [], "")
                or isinstance(default, bool) or action.nargs == 0):
            return text
        return f"{text} (default: %(default)s)"


def parsers(parser: argparse.ArgumentParser, path: str = "sara") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(command path, parser)`` of ``parser`` and every subcommand below it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def build_parser() -> argparse.ArgumentParser:
    """The ``sara`` parser with every command registered, each parser using ``HelpFormatter``."""
    from sara import __version__

    parser = argparse.ArgumentParser(
        prog="sara", description="SARA, Sequential Adaptive Rollout Allocation for RL with verifiable rewards "
        "(arXiv:2607.26253). Run 'sara <command> --help' for a command's options.")
    parser.add_argument("-V", "--version", action="version", version=f"sara {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name in COMMANDS:
        importlib.import_module(f"sara.commands.{name}").register(sub)
    for _, p in parsers(parser):
        p.formatter_class = HelpFormatter
        p.set_defaults(_parser=p)  # the deepest parser a command line reached: its usage for an unknown option
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:  # a subcommand without a description gets its help line
                    child = action.choices[choice.dest]
                    if not child.description and choice.help:
                        child.description = choice.help[0].upper() + choice.help[1:] + "."
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code (2 on a ``SaraError``, 130
    with one line instead of a traceback when a ``KeyboardInterrupt`` ends it)."""
    from sara.train.heap import bound_kernel_caches

    bound_kernel_caches()  # before any kernel runs: shape-keyed CPU kernel caches stay small in a long run
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the subcommand that was given them, with its usage (exits 2)
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    from sara.config import SaraError
    from sara.registry import clip

    try:
        from sara.commands.output import check_report_path

        check_report_path(getattr(args, "json_out", None))  # before any work: the report must be writable at the end
        return int(args.func(args) or 0)
    except SaraError as exc:
        print(f"sara: error: {clip(str(exc), MAX_ERROR_CHARS)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C, or the first one's grace period over (sara.train.guards)
        print("sara: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
