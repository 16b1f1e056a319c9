"""`pipesched simulate`: run one schedule through the cost model and print its figures."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipeline.cli.options import add_cost_arguments, add_schedule_arguments, chunks_of, cost_model
from schedules import Figures, build_schedule, figures, simulate

__all__ = ["format_figures", "register", "run"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "simulate", help="simulate a schedule: makespan, bubble, memory per rank",
        description="Generate, lower and simulate a schedule under a simple cost model.")
    add_schedule_arguments(parser)
    add_cost_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def format_figures(name: str, p: int, m: int, v: int, result: Figures) -> str:
    """A readable table of a simulation's figures."""
    lines = [
        f"schedule {name}   p={p}  m={m}  v={v}",
        f"makespan {result.makespan:.3f}   bubble_rate {result.bubble_rate:.4f}   "
        f"idle_fraction {result.idle_fraction:.4f}",
        "",
        f"{'rank':>4}  {'busy':>10}  {'peak activations':>16}  {'peak bytes':>12}",
    ]
    for rank, (busy, peak, peak_bytes) in enumerate(zip(result.busy, result.peak_activations,
                                                        result.peak_activation_bytes)):
        lines.append(f"{rank:>4}  {busy:>10.3f}  {peak:>16}  {peak_bytes:>12.0f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    costs = cost_model(args, chunks_of(args))
    schedule = build_schedule(args.schedule, args.stages, args.microbatches, args.chunks,
                              memory_limit=args.memory_limit, costs=costs)
    result = figures(simulate(schedule, costs))
    if args.json:
        payload = {"schedule": args.schedule, "num_ranks": schedule.num_ranks,
                   "num_microbatches": schedule.num_microbatches, "chunks": schedule.chunks,
                   **result.to_dict()}
        print(json.dumps(payload))
    else:
        print(format_figures(args.schedule, schedule.num_ranks, schedule.num_microbatches,
                             schedule.chunks, result))
    return 0
