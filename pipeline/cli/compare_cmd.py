"""`pipesched compare`: simulate several schedules for the same p, m and costs, side by side."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipeline.cli import UsageError
from pipeline.cli.options import (
    add_cost_arguments,
    add_schedule_arguments,
    check_size,
    cost_model,
    timeout_seconds,
)
from pipeline.cli.output_paths import figure_path
from schedules import (
    SCHEDULES,
    CostModel,
    Figures,
    Schedule,
    SolvedSchedule,
    Timeline,
    build_schedule,
    figures,
    simulate,
    solve_zb_optimal,
)
from schedules.search.zb_optimal import MAX_MICROBATCHES, MAX_RANKS
from viz import TABLE_COLUMNS, comparison_table, plot_comparison

__all__ = ["DEFAULT_SCHEDULES", "GAP_COLUMN", "format_table", "optimality_gaps", "register", "run",
           "schedule_names"]

DEFAULT_SCHEDULES = "gpipe,1f1b,interleaved"
GAP_COLUMN = "optimality gap"
"""Makespan above the proven optimum for the same placement and peak memory (zb-optimal)."""


def schedule_names(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated schedule names, each known and none twice."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated schedule names, got {text!r}; e.g. {DEFAULT_SCHEDULES}")
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown schedule {unknown[0]!r}; choose from: {', '.join(SCHEDULES)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"schedule {repeated[0]!r} is listed twice; "
                                         "list each schedule once")
    return names


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "compare", help="simulate several schedules with the same p, m and costs",
        description="Simulate several schedules for the same p, m and per-rank costs and "
                    "print makespan, bubble rate and peak activations of each; --plot "
                    "stacks their timelines on one time axis.")
    parser.add_argument("--schedules", type=schedule_names, default=DEFAULT_SCHEDULES,
                        metavar="NAMES", help="comma-separated schedule names (default "
                        f"{DEFAULT_SCHEDULES}; known: {', '.join(SCHEDULES)})")
    add_schedule_arguments(parser, single=False)
    add_cost_arguments(parser)
    parser.add_argument("--optimality-gap", type=timeout_seconds, nargs="?", const=10.0,
                        default=None,
                        metavar="SECONDS",
                        help=f"add an '{GAP_COLUMN}' column: each schedule's makespan above the "
                             "optimum (zb-optimal, CP-SAT) for its placement and its own peak "
                             f"memory; p <= {MAX_RANKS}, m <= {MAX_MICROBATCHES}; SECONDS per "
                             "solve (default 10); needs pip install ortools")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=figure_path, metavar="PATH",
                        help="save the stacked timelines and a figures table as .png or .svg")
    parser.set_defaults(func=run)


def _takes_chunks(name: str) -> bool:
    high = SCHEDULES[name].chunks[1]
    return high is None or high > 1


def _chunks_for(names: tuple[str, ...], chunks: int | None) -> list[int | None]:
    """--chunks goes to the schedules that take several chunks; the rest keep their own."""
    if chunks is not None and chunks > 1 and not any(map(_takes_chunks, names)):
        raise UsageError(
            f"--chunks {chunks} applies to none of {', '.join(names)}; add a schedule that "
            f"takes chunks ({', '.join(n for n in SCHEDULES if _takes_chunks(n))}) or drop "
            "--chunks")
    return [chunks if _takes_chunks(name) else None for name in names]


def format_table(rows: list[tuple[str, ...]],
                 columns: tuple[str, ...] = TABLE_COLUMNS) -> str:
    """`comparison_table` rows under `columns`, aligned for a terminal."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(columns, *rows)]
    lines = []
    for row in (columns, *rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def optimality_gaps(schedules: list[Schedule], results: list[Figures],
                    costs: list[CostModel], time_limit: float) -> list[SolvedSchedule | None]:
    """The proven optimum for each schedule's placement, costs and own peak memory (None for
    a forward-only schedule); one solve per distinct (placement, peak, costs)."""
    solved: dict[tuple[object, ...], SolvedSchedule] = {}
    # Each solve starts from the first schedule of its problem; a later, faster one with
    # the same placement and memory gets its own solve, so no row shows a negative gap.
    plans: list[SolvedSchedule | None] = []
    total = sum(1 for schedule in schedules if schedule.has_backward)
    for schedule, result, cost in zip(schedules, results, costs):
        if schedule.has_backward:  # a solve takes up to time_limit: say where it stands
            done = sum(1 for plan in plans if plan is not None)
            print(f"pipesched compare: optimality gap {done + 1}/{total} ({schedule.name}), "
                  f"at most {(total - done) * time_limit:.0f} s left", file=sys.stderr,
                  flush=True)
        if not schedule.has_backward:
            plans.append(None)
            continue
        peak = max(result.peak_activations)
        key = (schedule.placement, peak, cost)
        if key in solved and solved[key].makespan > result.makespan:
            del solved[key]
        if key not in solved:
            solved[key] = solve_zb_optimal(
                schedule.num_ranks, schedule.num_microbatches, schedule.chunks,
                memory_limit=peak, costs=cost, time_limit=time_limit,
                placement=schedule.placement, start_from=schedule)
        plans.append(solved[key])
    return plans


def _gap_text(makespan: float, plan: SolvedSchedule | None) -> str:
    if plan is None:
        return "-"
    low = max(0.0, makespan / plan.makespan - 1.0)
    if plan.proven:
        return f"{low:.1%}"
    high = makespan / plan.bound - 1.0 if plan.bound > 0 else float("inf")
    return f"{low:.1%}..{high:.1%}"  # the optimum is proven to lie in [bound, found]


def run(args: argparse.Namespace) -> int:
    names: tuple[str, ...] = args.schedules  # argparse applies `schedule_names` to the default
    if args.optimality_gap is not None and (args.stages > MAX_RANKS or
                                            args.microbatches > MAX_MICROBATCHES):
        raise UsageError(f"--optimality-gap needs --stages <= {MAX_RANKS} and --microbatches "
                         f"<= {MAX_MICROBATCHES} (the exact solve does not finish beyond); "
                         f"got {args.stages} and {args.microbatches}")
    timelines: list[Timeline] = []
    schedules: list[Schedule] = []
    all_costs: list[CostModel] = []
    every_chunks = _chunks_for(names, args.chunks)
    for name, chunks in zip(names, every_chunks):
        check_size(name, args, chunks)  # every schedule, before building the first
    for name, chunks in zip(names, every_chunks):
        costs = cost_model(args, chunks or SCHEDULES[name].default_chunks)
        tunable = SCHEDULES[name].plan is not None  # only cost-aware schedules take a limit
        schedule = build_schedule(name, args.stages, args.microbatches, chunks, costs=costs,
                                  memory_limit=args.memory_limit if tunable else None)
        schedules.append(schedule)
        all_costs.append(costs)
        timelines.append(simulate(schedule, costs))
    results = [figures(t) for t in timelines]
    plans: list[SolvedSchedule | None] = []
    if args.optimality_gap is not None:
        plans = optimality_gaps(schedules, results, all_costs, args.optimality_gap)
    gaps = [_gap_text(r.makespan, plan) for r, plan in zip(results, plans)]
    if args.json:
        rows = [{"schedule": n, "chunks": t.chunks, **r.to_dict()}
                for n, t, r in zip(names, timelines, results)]
        for row, plan in zip(rows, plans):
            row["optimum"] = None if plan is None else {
                "makespan": plan.makespan, "bound": plan.bound, "proven": plan.proven}
        print(json.dumps({"num_ranks": args.stages, "num_microbatches": args.microbatches,
                          "schedules": rows},
                         allow_nan=False))  # never JSON that parsers refuse
    else:
        print(f"p={args.stages}  m={args.microbatches}  (same per-rank costs for every "
              "schedule; a chunk of v costs 1/v and holds 1/v of a stage's activations: "
              "\"8 × 1/2\" is 4 stages' memory; the bubble rate counts the busiest rank's "
              "idle time within its span, the idle fraction every rank's)\n")
        table = comparison_table(timelines, results)
        if plans:
            print(format_table([(*row, gap) for row, gap in zip(table, gaps)],
                               (*TABLE_COLUMNS, GAP_COLUMN)))
        else:
            print(format_table(table))
    if args.plot:
        plot_comparison(timelines, args.plot)
        print(f"pipesched compare: wrote {args.plot}", file=sys.stderr)
    return 0
