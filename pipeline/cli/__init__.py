"""The `pipesched` command line: one subcommand per module, errors as one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["COMMAND_MODULES", "ArgumentParser", "UsageError", "build_parser", "main"]

# Each module defines register(subparsers) adding a parser whose `func(args) -> int` runs it.
# By command name, so that a run imports only its own command's module (the partition
# command need not load the simulator, the plots or torch); `--help` loads them all.
COMMAND_MODULES = {
    "simulate": "pipeline.cli.simulate_cmd",
    "schedule": "pipeline.cli.schedule_cmd",
    "compare": "pipeline.cli.compare_cmd",
    "partition": "pipeline.cli.partition_cmd",
    "train": "pipeline.cli.train_cmd",
    "validate": "pipeline.cli.validate_cmd",
    "verify-checkpoint": "pipeline.cli.checkpoint_cmd",
    "rehearse": "pipeline.cli.rehearse_cmd",
    "plan": "pipeline.cli.plan_cmd",
    "profile-device": "pipeline.cli.profile_device_cmd",
}


class UsageError(ValueError):
    """A command-line value is invalid; the message names it and the allowed values."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2, no usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(command: str | None = None) -> ArgumentParser:
    """The `pipesched` parser with every subcommand, or only `command`'s when it is known."""
    parser = ArgumentParser(
        prog="pipesched",
        description="Pipeline-parallel training: partition, schedule, simulate, plot, train.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=ArgumentParser)
    names = [command] if command in COMMAND_MODULES else list(COMMAND_MODULES)
    for name in names:
        importlib.import_module(COMMAND_MODULES[name]).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pipesched` console script."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(arguments[0] if arguments else None)
    args = parser.parse_args(arguments)
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
