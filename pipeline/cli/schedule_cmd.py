"""`pipesched schedule`: print every rank's instruction stream in the text form."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.cli.options import add_schedule_arguments, check_size
from schedules import build_schedule, generate_schedule

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "schedule", help="print each rank's instruction stream",
        description="Print every rank's lowered stream (send/recv, loads, reduce-grad, step) "
                    "one rank a line, in the text form that parses back.")
    add_schedule_arguments(parser)
    parser.add_argument("--compute-only", action="store_true",
                        help="print the generator's compute order before lowering")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    check_size(args.schedule, args, args.chunks, lowered=not args.compute_only)
    make = generate_schedule if args.compute_only else build_schedule
    print(make(args.schedule, args.stages, args.microbatches, args.chunks,
               memory_limit=args.memory_limit).format())
    return 0
