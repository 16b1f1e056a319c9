"""The `pipesched` command line: one subcommand per module, errors as one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["ArgumentParser", "UsageError", "build_parser", "main"]

# Each module defines register(subparsers) adding a parser whose `func(args) -> int` runs it.
_COMMAND_MODULES = (
    "pipeline.cli.simulate_cmd",
    "pipeline.cli.schedule_cmd",
    "pipeline.cli.compare_cmd",
    "pipeline.cli.partition_cmd",
    "pipeline.cli.train_cmd",
    "pipeline.cli.validate_cmd",
    "pipeline.cli.checkpoint_cmd",
    "pipeline.cli.plan_cmd",
)


class UsageError(ValueError):
    """A command-line value is invalid; the message names it and the allowed values."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2, no usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="pipesched",
        description="Pipeline-parallel training: partition, schedule, simulate, plot, train.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=ArgumentParser)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pipesched` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except (ValueError, TypeError, OSError) as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"pipesched {args.command}: error: {first_line}", file=sys.stderr)
        rest = str(error).splitlines()[1:]
        if rest:
            print("\n".join(rest), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
