"""`pipesched simulate`: run one schedule through the cost model, print its figures, plot it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.options import (
    add_cost_arguments,
    add_gather_arguments,
    add_reduction_arguments,
    add_schedule_arguments,
    check_size,
    chunks_of,
    cost_model,
    grad_reduction,
    non_negative_float,
    param_gather,
    positive_int,
)
from pipeline.cli.output_paths import figure_path, trace_path
from schedules import Figures, Timeline, build_schedule, figures, simulate
from schedules.analysis.memory import MemoryModel, RankMemory, predict_memory
from viz import plot_memory, plot_timeline, write_trace  # matplotlib loads only when plotting

__all__ = ["add_memory_arguments", "add_output_arguments", "format_figures", "format_memory",
           "register", "run", "write_outputs"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "simulate", help="simulate a schedule: makespan, bubble, memory per rank",
        description="Generate, lower and simulate a schedule under a simple cost model.")
    add_schedule_arguments(parser)
    add_cost_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_memory_arguments(parser)
    add_reduction_arguments(parser)
    add_gather_arguments(parser)
    add_output_arguments(parser)
    parser.set_defaults(func=run)


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """Predict memory per rank from --params-bytes and the setup (schedules.analysis.memory)."""
    group = parser.add_argument_group(
        "memory per rank (printed when --params-bytes is given; activations are "
        "--activation-bytes per microbatch held)")
    group.add_argument("--params-bytes", type=non_negative_float, default=None,
                       metavar="BYTES", help="parameter bytes of one stage")
    group.add_argument("--data-parallel", type=positive_int, default=1, metavar="D",
                       help="replicas (ZeRO-1 shards the optimizer state over them)")
    group.add_argument("--zero-stage", type=int, choices=(0, 1), default=0)
    group.add_argument("--optimizer-factor", type=non_negative_float, default=2.0,
                       metavar="X", help="optimizer-state bytes per parameter byte "
                       "(Adam 2, the default; SGD 0)")


def format_memory(memory: tuple[RankMemory, ...]) -> str:
    """Predicted bytes per rank, one row each."""
    lines = [f"{'rank':>4}  {'params':>12}  {'gradients':>12}  {'optimizer':>12}  "
             f"{'activations':>12}  {'total':>12}"]
    for r in memory:
        lines.append(f"{r.rank:>4}  {r.params:>12.0f}  {r.gradients:>12.0f}  "
                     f"{r.optimizer:>12.0f}  {r.activations:>12.0f}  {r.total:>12.0f}")
    return "\n".join(lines)


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """--plot, --memory-plot and --trace: files checked writable while parsing."""
    group = parser.add_argument_group("output files (checked writable before simulating)")
    group.add_argument("--plot", type=figure_path, metavar="PATH",
                       help="save the timeline (Gantt chart) as .png or .svg")
    group.add_argument("--memory-plot", type=figure_path, metavar="PATH",
                       help="save activations in flight per rank over time as .png or .svg")
    group.add_argument("--trace", type=trace_path, metavar="PATH",
                       help="save a Chrome / Perfetto trace (.json), one process per rank")


def format_figures(name: str, p: int, m: int, v: int, result: Figures) -> str:
    """A readable table of a simulation's figures."""
    lines = [
        f"schedule {name}   p={p}  m={m}  v={v}",
        f"makespan {result.makespan:.3f}   bubble_rate {result.bubble_rate:.4f}   "
        f"idle_fraction {result.idle_fraction:.4f}",
        "",
        f"{'rank':>4}  {'busy':>10}  {'peak activations':>16}  {'peak bytes':>12}",
    ]
    if result.step is not None:  # a simulated reduction or gather: their columns, the step
        parts = [name for name, on in (("the gradient reduction", result.exposed_reduction),
                                       ("the parameter gather", result.exposed_gather)) if on]
        lines[1] += f"   step {result.step:.3f} (with {' and '.join(parts)})"
        if result.exposed_reduction:
            lines[-1] += f"  {'exposed reduction':>17}"
        if result.exposed_gather:
            lines[-1] += f"  {'exposed gather':>14}"
    for rank, (busy, peak, peak_bytes) in enumerate(zip(result.busy, result.peak_activations,
                                                        result.peak_activation_bytes)):
        lines.append(f"{rank:>4}  {busy:>10.3f}  {peak:>16}  {peak_bytes:>12.0f}")
        if result.exposed_reduction:
            lines[-1] += f"  {result.exposed_reduction[rank]:>17.3f}"
        if result.exposed_gather:
            lines[-1] += f"  {result.exposed_gather[rank]:>14.3f}"
    return "\n".join(lines)


def write_outputs(args: argparse.Namespace, timeline: Timeline) -> None:
    """Write the files asked for by `add_output_arguments`; a line on stderr for each."""
    paths: list[Path] = [p for p in (args.plot, args.memory_plot, args.trace) if p]
    if len({p.resolve() for p in paths}) < len(paths):
        raise ValueError("--plot, --memory-plot and --trace name the same file; "
                         "give each its own path")
    if args.plot:
        plot_timeline(timeline, args.plot)
    if args.memory_plot:
        plot_memory(timeline, args.memory_plot)
    if args.trace:
        write_trace(timeline, args.trace)
    for path in paths:
        print(f"pipesched {args.command}: wrote {path}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    check_size(args.schedule, args, args.chunks)
    costs = cost_model(args, chunks_of(args))
    reduction = grad_reduction(args, chunks_of(args))
    gather = param_gather(args, chunks_of(args))
    schedule = build_schedule(args.schedule, args.stages, args.microbatches, args.chunks,
                              memory_limit=args.memory_limit, costs=costs)
    timeline = simulate(schedule, dataclasses.replace(costs, reduction=reduction,
                                                      gather=gather))
    result = figures(timeline)
    memory = None
    if args.params_bytes is not None:
        memory = predict_memory(schedule, MemoryModel(
            params=args.params_bytes, saved=args.activation_bytes,
            data_parallel=args.data_parallel, zero_stage=args.zero_stage,
            optimizer_factor=args.optimizer_factor))
    if args.json:
        payload = {"schedule": args.schedule, "num_ranks": schedule.num_ranks,
                   "num_microbatches": schedule.num_microbatches, "chunks": schedule.chunks,
                   **result.to_dict()}
        if memory is not None:
            payload["memory"] = [r.to_dict() for r in memory]
        print(json.dumps(payload, allow_nan=False))  # never JSON that parsers refuse
    else:
        print(format_figures(args.schedule, schedule.num_ranks, schedule.num_microbatches,
                             schedule.chunks, result))
        if memory is not None:
            print("\npredicted memory per rank (bytes)\n" + format_memory(memory))
    write_outputs(args, timeline)
    return 0
