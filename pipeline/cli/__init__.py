"""The `pipesched` command line: one subcommand per module, every failure as one line with a
documented exit code (`EXIT_CODES`)."""

from __future__ import annotations

import argparse
import difflib
import importlib
import linecache
import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pipeline.launcher.console import guard_standard_streams

__all__ = ["COMMAND_MODULES", "EXIT_CODES", "EXIT_INPUT", "EXIT_INTERRUPTED", "EXIT_RUN_FAILED",
           "ArgumentParser", "UsageError", "build_parser", "did_you_mean", "main",
           "report_run_failure"]

EXIT_INPUT = 2
"""A command-line value or an input file is invalid (the message names it and the fix)."""
EXIT_RUN_FAILED = 3
"""A launched job failed: one line names the rank and the cause (the full report is in the
command's output folder where it has one)."""
EXIT_INTERRUPTED = 130
"""Interrupted (Ctrl-C)."""
EXIT_CODES = {0: "success", 1: "an internal error (a bug: its traceback is printed)",
              EXIT_INPUT: "invalid input: a value, a file or a combination the command refuses",
              EXIT_RUN_FAILED: "a launched job failed (a rank's error, a stall, a non-finite "
                               "loss); the full report is in the output folder",
              EXIT_INTERRUPTED: "interrupted (Ctrl-C)"}
_OURS = tuple(str(Path(__file__).resolve().parents[2] / package) + os.sep
              for package in ("schedules", "partition", "pipeline", "viz"))

# Each module defines register(subparsers) adding a parser whose `func(args) -> int` runs it.
# By command name, so that a run imports only its own command's module (the partition
# command need not load the simulator, the plots or torch); `--help` loads them all.
COMMAND_MODULES = {
    "simulate": "pipeline.cli.simulate_cmd",
    "schedule": "pipeline.cli.schedule_cmd",
    "compare": "pipeline.cli.compare_cmd",
    "partition": "pipeline.cli.partition_cmd",
    "train": "pipeline.cli.train_cmd",
    "run": "pipeline.cli.run_cmd",
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
        self.exit(2, f"{self.prog}: error: {message}{did_you_mean(message)}\n")


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<value>[^']*)' \(choose from (?P<choices>.*)\)")


def did_you_mean(message: str) -> str:
    """For argparse's "invalid choice" message, "; did you mean 'zb-v'?" naming the closest
    choices (difflib's ratio >= 0.6, as argparse's own suggestions in Python 3.14); else ""."""
    found = _INVALID_CHOICE.search(message)
    if found is None:
        return ""
    choices = re.findall(r"'([^']*)'", found["choices"])
    close = difflib.get_close_matches(found["value"], choices, n=2)
    return f"; did you mean {' or '.join(repr(choice) for choice in close)}?" if close else ""


def build_parser(command: str | None = None) -> ArgumentParser:
    """The `pipesched` parser with every subcommand, or only `command`'s when it is known."""
    parser = ArgumentParser(
        prog="pipesched",
        description="Pipeline-parallel training: partition, schedule, simulate, plot, train.",
        epilog="exit codes: " + "; ".join(f"{code} {meaning}"
                                          for code, meaning in EXIT_CODES.items()),
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=ArgumentParser)
    names = [command] if command in COMMAND_MODULES else list(COMMAND_MODULES)
    for name in names:
        importlib.import_module(COMMAND_MODULES[name]).register(subparsers)
    return parser


def _deliberate(error: TypeError) -> bool:
    """Whether our own code raised `error` on purpose (a ``raise`` statement in our packages,
    refusing a value of the wrong type), not a bug that tripped over a wrong type."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    line = last.line or linecache.getline(last.filename, last.lineno or 0)
    return os.path.realpath(last.filename).startswith(_OURS) and \
        line.strip().startswith("raise ")


def _one_line(command: str, error: BaseException) -> None:
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    print(f"pipesched {command}: error: {first_line}", file=sys.stderr)


def _write_failure(out: Path | None, text: str) -> str:
    """Write `text` to ``out/failure.txt``; the clause pointing at it ("" if not written)."""
    if out is None:
        return ""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "failure.txt").write_text(text)
    except OSError:
        return ""
    return f" (full report: {out / 'failure.txt'})"


def report_run_failure(command: str, error: BaseException, out: Path | None) -> int:
    """Print a launched job's failure as one line (the full report, tracebacks included, in
    ``out/failure.txt`` when `out` is given) and return `EXIT_RUN_FAILED`."""
    where = ""
    if out is not None:
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "failure.txt").write_text(f"{type(error).__name__}: {error}\n")
            where = f" (full report: {out / 'failure.txt'})"
        except OSError:
            pass
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    print(f"pipesched {command}: error: {first_line}{where}", file=sys.stderr)
    return EXIT_RUN_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pipesched` console script."""
    if argv is None:  # a process of its own: a closed or full stdout must not fail the run
        guard_standard_streams()
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(arguments)
    except KeyboardInterrupt:  # during the imports and parsing, before a command runs
        named = arguments[0] if arguments and arguments[0] in COMMAND_MODULES else None
        print(f"pipesched{' ' + named if named else ''}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(arguments: list[str]) -> int:
    from pipeline.errors import RankFailedError

    parser = build_parser(arguments[0] if arguments else None)
    args = parser.parse_args(arguments)
    try:
        code: int = args.func(args)
    except RankFailedError as error:
        return report_run_failure(args.command, error, None)
    except BrokenPipeError:  # `pipesched ... | head -1`: the reader has what it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the flush at exit must not fail again
        os.close(devnull)
        return 0
    except (ValueError, OSError) as error:
        details = getattr(error, "details", None)  # UserCodeError: the user's --model raised
        if isinstance(details, str):
            where = _write_failure(getattr(args, "out", None), details)
            print(f"pipesched {args.command}: error: {error}{where}", file=sys.stderr)
            return EXIT_INPUT
        _one_line(args.command, error)
        rest = str(error).splitlines()[1:]
        if rest:
            print("\n".join(rest), file=sys.stderr)
        return EXIT_INPUT
    except TypeError as error:
        if not _deliberate(error):
            raise  # a bug: keep its traceback (exit 1)
        _one_line(args.command, error)
        return EXIT_INPUT
    except KeyboardInterrupt:
        print(f"pipesched {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":
    sys.exit(main())
