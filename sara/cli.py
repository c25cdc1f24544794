"""The ``sara`` command line: ``sara <command> [<subcommand>] [options]``.

Each command lives in its own module under ``sara.commands`` exposing ``register(subparsers)``; the module adds its
parser(s) and sets ``func`` (called with the parsed args, returns an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules under sara.commands, in help order. Add a command by adding a module here.
COMMANDS: tuple[str, ...] = ("train", "matrix", "bench", "model")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sara", description="Sequential Adaptive Rollout Allocation for RLVR.")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name in COMMANDS:
        importlib.import_module(f"sara.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    from sara.config import SaraError

    try:
        return int(args.func(args) or 0)
    except SaraError as exc:
        print(f"sara: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
