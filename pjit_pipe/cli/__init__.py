"""The `pjit-pipe` command line.

Each subcommand lives in its own module under `pjit_pipe.cli` and exposes
`register(subparsers)`, which adds its parser and sets `run=<function(args) -> int>`
as a default. Modules are imported only when the CLI starts, so a subcommand's
heavy imports (JAX, Flax) never slow down the others' `--help`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# The module of each subcommand (pjit_pipe.cli.<module>): add yours here.
SUBCOMMANDS = {
    "schedule": "schedule_command",
    "train": "train_command",
    "demo": "demo",
    "plan": "plan",
    "probe": "probe",
    "emulate": "emulate",
    "memory": "memory_command",
}


class UsageError(Exception):
    """A bad command line; main() prints it as one line."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports errors as a single line instead of usage + message."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand of SUBCOMMANDS registered."""
    parser = OneLineParser(prog="pjit-pipe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(f"pjit_pipe.cli.{module}").register(sub)
    return parser


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; return the exit status (0 ok, 2 bad usage, 1 any other error)."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        print(_one_line(f"error: {e}"), file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except UsageError as e:
        print(_one_line(f"error: {e}"), file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:  # ScheduleError is a ValueError
        print(_one_line(f"error: pjit-pipe {args.command}: {e}"), file=sys.stderr)
        return 1
