"""`pipesched rehearse`: run a schedule on local ranks with emulated compute from a cost file,
and put the measured timeline next to the simulated ones, with figures and memory per rank."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.options import add_schedule_arguments, fraction, positive_float, positive_int
from pipeline.files import InputFileType
from pipeline.limits import MAX_INPUT_BYTES
from schedules import SCHEDULES, Timeline, build_schedule, figures, simulate
from schedules.analysis.memory import RankMemory

_MAX_REHEARSAL_SECONDS = 3600.0  # a rehearsal previews a run: an hour of emulated steps at most
__all__ = ["format_memory", "register", "run"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "rehearse", help="run a schedule on local ranks with emulated compute from a cost file",
        description="Build layers that wait the F, I and W times of a cost file (the "
                    "partitioner's JSON) and send their activation bytes, run them with the "
                    "real engine on P × D local processes, and plot the measured timeline "
                    "under the simulated ones (nominal costs, and with this machine's host "
                    "work and P2P measured on the run), with memory per rank predicted and "
                    "measured.")
    parser.add_argument("--costs", type=InputFileType(MAX_INPUT_BYTES, json_document=True),
                        required=True, metavar="FILE",
                        help="per-layer costs: partitioner JSON (seconds, bytes)")
    add_schedule_arguments(parser, memory_limit=False)
    parser.add_argument("--data-parallel", type=positive_int, default=1, metavar="D",
                        help="pipeline replicas; P × D processes in all (default 1)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1), default=0,
                        help="1: shard the optimizer state over the replicas (ZeRO-1)")
    parser.add_argument("--partition", default="balanced", metavar="METHOD",
                        help="how to cut the layers: balanced (default), uniform, parameters, "
                             "type:<regex>")
    parser.add_argument("--weight-fraction", type=fraction, default=0.5, metavar="F",
                        help="share of each layer's backward that is W (default 0.5)")
    parser.add_argument("--time-scale", type=positive_float, default=1.0, metavar="X",
                        help="multiply every time by X (default 1)")
    parser.add_argument("--bytes-scale", type=positive_float, default=1.0, metavar="X",
                        help="divide activation and parameter bytes by X (default 1)")
    parser.add_argument("--steps", type=positive_int, default=5, metavar="N",
                        help="timed steps; the one of median makespan is shown (default 5)")
    parser.add_argument("--out", type=Path, default=Path("rehearsal-out"), metavar="DIR",
                        help="directory for rehearsal.png, trace.json and summary.json")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def format_memory(predicted: list[RankMemory], measured: list[RankMemory]) -> str:
    """Bytes per rank, predicted / measured, with the ratio of the totals."""
    def mib(value: float) -> str:
        return f"{value / 2**20:.2f}"

    lines = [f"{'rank':>4}  {'params MiB':>14}  {'grads MiB':>14}  {'optimizer MiB':>14}  "
             f"{'activations MiB':>16}  {'in flight':>9}  {'total: meas/pred':>16}",
             f"{'':>4}  {'pred / meas':>14}  {'pred / meas':>14}  {'pred / meas':>14}  "
             f"{'pred / meas':>16}  {'pred/meas':>9}"]
    for p, m in zip(predicted, measured):
        ratio = m.total / p.total if p.total else float("nan")
        lines.append(
            f"{p.rank:>4}  {mib(p.params) + ' / ' + mib(m.params):>14}  "
            f"{mib(p.gradients) + ' / ' + mib(m.gradients):>14}  "
            f"{mib(p.optimizer) + ' / ' + mib(m.optimizer):>14}  "
            f"{mib(p.activations) + ' / ' + mib(m.activations):>16}  "
            f"{f'{p.peak_in_flight}/{m.peak_in_flight}':>9}  {ratio:>16.3f}")
    return "\n".join(lines)


def _check_emulated_memory(spec: Any) -> None:
    """Refuse, before any rank starts, a rehearsal whose ranks together would not fit in this
    host's memory: every rank's parameters, gradients, Adam state and activation peak under
    the schedule (the one accounting, `schedules.analysis.memory.predict_memory`, which the
    report's predicted column shows), times the replicas, plus each process's own
    `RANK_BYTES`. Counting parameters once let a rank reach 15.6 GB on a host this refused
    nothing for; costs of 1e300 bytes ended in a C++ allocation failure on the ranks."""
    from pipeline.limits import RANK_BYTES, host_memory_bytes
    from schedules.analysis.memory import predict_memory

    schedule = build_schedule(spec.schedule, spec.stages, spec.microbatches, spec.chunks)
    per_rank = predict_memory(schedule, spec.memory_model())
    needed = spec.data_parallel * (sum(rank.total for rank in per_rank)
                                   + spec.stages * RANK_BYTES)
    memory = host_memory_bytes()
    if not needed <= memory:  # also inf and NaN
        states = sum(rank.params + rank.gradients + rank.optimizer for rank in per_rank)
        raise ValueError(f"the costs file's params, gradients, Adam state and activations "
                         f"would take about {needed:.3g} bytes once emulated, over this "
                         f"host's {memory:.3g} (model state {spec.data_parallel * states:.3g} "
                         "of it); raise --bytes-scale or give costs in bytes")


def _spec(args: argparse.Namespace) -> Any:
    """Read and check everything (costs, schedule, partition) before any process starts."""
    from partition import graph_from_json, parse_method, partition_graph
    from pipeline.limits import check_local_ranks

    chunks = args.chunks if args.chunks is not None else SCHEDULES[args.schedule].default_chunks
    build_schedule(args.schedule, args.stages, args.microbatches, chunks)  # refuses bad p/m/v
    check_local_ranks(args.stages * args.data_parallel, "--stages × --data-parallel")
    if args.stages < 2:
        raise ValueError(f"--stages {args.stages}: a rehearsal needs at least 2 pipeline ranks")
    if args.zero_stage and args.data_parallel < 2:
        raise ValueError("--zero-stage 1 shards over replicas: give --data-parallel 2 or more")
    graph = graph_from_json(args.costs)
    method, pattern = parse_method(args.partition)
    part = partition_graph(graph, args.stages * chunks, method=method, type_pattern=pattern)
    from pipeline.rehearsal.rehearse import RehearsalSpec, emulation_costs  # torch, from here
    from viz import FIGURE_FORMATS, TRACE_FORMATS, check_output_path

    layers = emulation_costs(graph, weight_fraction=args.weight_fraction,
                             bytes_scale=args.bytes_scale, time_scale=args.time_scale)
    spec = RehearsalSpec(layers=tuple(layers), boundaries=tuple(part.boundaries),
                         schedule=args.schedule, stages=args.stages, chunks=chunks,
                         microbatches=args.microbatches, data_parallel=args.data_parallel,
                         zero_stage=args.zero_stage, steps=args.steps)
    _check_emulated_memory(spec)
    args.out.mkdir(parents=True, exist_ok=True)
    check_output_path(args.out / "rehearsal.png", FIGURE_FORMATS)
    check_output_path(args.out / "trace.json", TRACE_FORMATS)
    return spec


def _for_plot(timeline: Timeline, name: str, saved: tuple[float, ...]) -> Timeline:
    """In seconds, named, and sized by the bytes a microbatch leaves saved per stage (so the
    figures' peak bytes are activation memory, measured run included)."""
    return dataclasses.replace(timeline, unit="s", name=name, activation_bytes=saved)


def run(args: argparse.Namespace) -> int:
    spec = _spec(args)  # every input checked, torch-free until the costs are read
    from pipeline.cli import report_run_failure
    from pipeline.errors import RankFailedError
    from pipeline.launcher.processes import launch
    from pipeline.limits import check_run_seconds
    from pipeline.rehearsal.rehearse import RehearsalReport, rehearse_rank
    from schedules.analysis.host import measure_host_costs, with_host_costs
    from schedules.analysis.memory import predict_memory
    from viz import comparison_table, plot_comparison, write_trace

    world = spec.stages * spec.data_parallel
    print(f"rehearsing {spec.schedule} on {world} local ranks (p={spec.stages}, "
          f"dp={spec.data_parallel}, v={spec.chunks}, m={spec.microbatches}), boundaries "
          f"{list(spec.boundaries)}", file=sys.stderr)
    schedule = build_schedule(spec.schedule, spec.stages, spec.microbatches, spec.chunks)
    nominal = spec.cost_model()
    # a wait inside a step may last a whole nominal step (and more on a loaded host)
    step = figures(simulate(schedule, nominal)).makespan
    check_run_seconds(spec.steps * step, f"--steps {spec.steps:,} or --time-scale",
                      limit=_MAX_REHEARSAL_SECONDS)
    try:
        report: RehearsalReport | None = launch(rehearse_rank, world, spec,
                                                timeout=max(120.0, 20 * step),
                                                quiet=True)[0]
    except RankFailedError as error:
        return report_run_failure("rehearse", error, args.out)
    if report is None:
        raise RuntimeError("rank 0 returned no report")
    # Simulate the same schedule: nominal costs, then with the host work and the link
    # this run measured.
    host = measure_host_costs(report.timeline, nominal)
    machine = with_host_costs(nominal, host, schedule, report.link)
    # the data-parallel reduction, each stage's as long as it took alone (none when d = 1)
    machine = dataclasses.replace(machine,
                                  reduction=spec.grad_reduction(report.reduction_seconds))
    saved = spec.memory_model().saved
    saved_bytes = tuple(saved) if not isinstance(saved, float | int) else ()
    timelines = [_for_plot(simulate(schedule, nominal), "simulated", saved_bytes),
                 _for_plot(simulate(schedule, machine), "simulated + machine", saved_bytes),
                 _for_plot(report.timeline, "measured", saved_bytes)]
    results = [figures(t) for t in timelines]
    predicted = list(predict_memory(schedule, spec.memory_model()))
    out: Path = args.out
    plot_comparison(timelines, out / "rehearsal.png",
                    title=f"rehearsal of {spec.schedule}   p={spec.stages}  m={spec.microbatches}"
                          f"  v={spec.chunks}   measured vs simulated (red dashes: makespan)")
    write_trace(report.timeline, out / "trace.json")
    summary = {
        "schedule": spec.schedule, "stages": spec.stages, "chunks": spec.chunks,
        "microbatches": spec.microbatches, "data_parallel": spec.data_parallel,
        "boundaries": list(spec.boundaries), "step_seconds": report.step_seconds,
        "link": {"latency": report.link.latency, "bandwidth": report.link.bandwidth},
        "host_seconds_per_op": {f"{s}{k.value}": v for (k, s), v in host.per_op.items()},
        "timelines": [{"name": t.name, **r.to_dict()} for t, r in zip(timelines, results)],
        "memory": {"predicted": [m.to_dict() for m in predicted],
                   "measured": [m.to_dict() for m in report.memory]},
    }
    if results[1].step is not None:
        summary["exposed_reduction"] = {"measured": report.exposed_reduction,
                                        "simulated": list(results[1].exposed_reduction)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if args.json:
        print(json.dumps(summary))
    else:
        from pipeline.cli.compare_cmd import format_table

        print(format_table(comparison_table(timelines, results)))
        ratio = results[2].makespan / results[1].makespan
        print(f"\nmeasured / simulated with host work: {ratio:.3f}   (nominal: "
              f"{results[2].makespan / results[0].makespan:.3f});  link latency "
              f"{report.link.latency * 1e6:.0f} µs;  host work {host.mean() * 1e6:.0f} µs "
              "per compute op (mean over kinds and stages)\n")
        print(format_memory(predicted, report.memory))
        if results[1].step is not None:
            print("\nexposed gradient reduction per rank, ms (measured / simulated with each "
                  "stage's reduction timed alone): " + ",  ".join(
                      f"{m * 1e3:.2f} / {s * 1e3:.2f}" for m, s in
                      zip(report.exposed_reduction, results[1].exposed_reduction)))
    for name in ("rehearsal.png", "trace.json", "summary.json"):
        print(f"pipesched rehearse: wrote {out / name}", file=sys.stderr)
    return 0
