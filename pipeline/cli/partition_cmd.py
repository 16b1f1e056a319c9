"""`pipesched partition`: split a JSON cost file into pipeline stages and print the result."""

from __future__ import annotations

import argparse
import json
import re
import sys
from itertools import pairwise

from partition import (
    InvalidOptionError,
    graph_from_json,
    parse_method,
    parse_schedule_memory,
    partition_graph,
)
from pipeline.cli.options import positive_int
from pipeline.cli.output_paths import figure_path
from pipeline.files import InputFileType
from pipeline.limits import MAX_INPUT_BYTES, MAX_NUMBER

__all__ = ["parse_bytes", "parse_cuts", "parse_numbers", "register", "run"]

_DESCRIPTION = """\
Split a model, described by per-layer costs in a JSON file, into P contiguous pipeline
stages. The default method, balanced, minimises the slowest stage's time (compute plus the
tensors it sends and receives across cuts) under an optional per-stage memory cap, exactly.

JSON format (times in seconds, sizes in bytes):
  {"layers": [{"name": "embed", "forward": 0.002, "backward": 0.004,
               "params": 4096000, "activation": 262144}, ...],
   "edges": [[from, to, bytes], ...],     (optional; default: a chain carrying activations)
   "bandwidth": 25e9}                     (optional; default: communication is free)
"""

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> float:
    """``"16GiB"``, ``"1.5e9"``, ``"512MB"`` or ``"80G"`` as a number of bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]i?)?[bB]?\s*", text)
    try:
        if match is None:
            raise ValueError(text)
        number = float(match.group(1))
        unit = (match.group(2) or "").lower()
        value = number * (_BINARY[unit] if unit.endswith("i") else _UNITS[unit])
    except ValueError as error:
        raise InvalidOptionError(
            f"{text!r} is not a byte size; write e.g. 17179869184, 16GiB, 1.5e9 or 512MB"
        ) from error
    if not 1 <= value <= MAX_NUMBER:  # also inf and NaN; 1e-300 printed 300-digit times
        raise InvalidOptionError(f"{text!r} is {value:g} bytes, outside 1..{MAX_NUMBER:g}; "
                                 "give a byte size such as 16GiB or 25e9")
    return value


def parse_numbers(text: str, what: str) -> list[float]:
    """A comma-separated list of numbers such as ``"0,4,9,12"`` or ``"1,1,0.5"``."""
    try:
        numbers = [float(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise InvalidOptionError(
            f"--{what} {text!r} must be comma-separated numbers, e.g. 0,4,9,12 or 1,1,0.5,1"
        ) from error
    if not all(abs(number) <= MAX_NUMBER for number in numbers):  # also inf and NaN
        raise InvalidOptionError(f"--{what} {text[:60]!r}: every number must be finite and at "
                                 f"most {MAX_NUMBER:g} in size")
    return numbers


def parse_cuts(text: str) -> list[int]:
    """Comma-separated integer layer indices such as ``"0,4,9,12"``."""
    numbers = parse_numbers(text, "boundaries")
    if any(not number.is_integer() for number in numbers):
        raise InvalidOptionError(f"--boundaries {text!r} must be integer layer indices")
    return [int(number) for number in numbers]


_SPEED_RANGE = 1e6


def _speeds(text: str) -> list[float]:
    """--speeds, refused when one stage is over a million times faster than another: such
    a ratio is a typo (1e-308), and its times print as numbers of hundreds of digits."""
    speeds = parse_numbers(text, "speeds")
    positive = [speed for speed in speeds if speed > 0]
    if positive and max(positive) > _SPEED_RANGE * min(positive):
        raise InvalidOptionError(f"--speeds {text!r}: the fastest stage is "
                                 f"{max(positive) / min(positive):.3g} times the slowest, over "
                                 f"{_SPEED_RANGE:g}; give relative speeds such as 1,1,0.5,2")
    return speeds


_MAX_SOLVER_STEPS = 10**9
"""Bound on the exact solvers' work: p·n for a chain (a probe of the chain solvers), p·n²
for a DAG with skip edges (its dynamic program, partition/dag.py); 4,000 DAG nodes into
2,000 stages (3·10^10) ran for over a minute."""


def _check_work(num_layers: int, stages: object, chain: bool) -> None:
    """Refuse, before solving, a request whose solver work is over `_MAX_SOLVER_STEPS`."""
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        return  # partition_graph names a bad stage count itself
    work = stages * num_layers * (1 if chain else num_layers)
    if work > _MAX_SOLVER_STEPS:
        formula = "p·n" if chain else "p·n² (a DAG with skip edges)"
        raise InvalidOptionError(
            f"--stages {stages:,} over {num_layers:,} layers is {work:.2g} solver steps "
            f"({formula}), over the limit of {_MAX_SOLVER_STEPS:.0e}; use fewer --stages or "
            "group layers into blocks in the cost file")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``partition`` subcommand to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "partition",
        help="split a model's per-layer costs (JSON) into balanced pipeline stages",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--costs", required=True, type=InputFileType(MAX_INPUT_BYTES,
                                                                      json_document=True),
                        metavar="FILE.json", help="per-layer cost file")
    parser.add_argument("--stages", required=True, type=positive_int, metavar="P",
                        help="pipeline stages")
    parser.add_argument(
        "--method",
        default="balanced",
        help="balanced (default), uniform, parameters, type:<regex> (balance the layers "
        "whose type matches, case-insensitive), or explicit (with --boundaries)",
    )
    parser.add_argument(
        "--boundaries", metavar="0,B1,...,N", help="stage boundaries for --method explicit"
    )
    parser.add_argument(
        "--memory-cap", metavar="BYTES", help="per-stage memory cap, e.g. 17179869184 or 16GiB"
    )
    parser.add_argument(
        "--schedule",
        default="1f1b",
        choices=["1f1b", "gpipe"],
        help="activation lifetime for memory: 1f1b (stage k holds min(P-k, M) microbatches, "
        "default) or gpipe (all M)",
    )
    parser.add_argument(
        "--microbatches", type=positive_int, metavar="M", help="microbatches per step (default: P)"
    )
    parser.add_argument(
        "--speeds", metavar="S0,...", help="relative speed of each stage (default: all 1)"
    )
    parser.add_argument(
        "--bandwidth",
        metavar="BYTES_PER_S",
        help="override the file's bandwidth between stages, e.g. 25e9 or 25GB",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the result as JSON instead of a table"
    )
    parser.add_argument("--plot", type=figure_path, metavar="PATH",
                        help="save per-stage compute/comm/memory bars as .png or .svg")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Partition the cost file as the arguments ask and print the table (or JSON)."""
    graph = graph_from_json(args.costs)
    _check_work(graph.num_layers, args.stages, graph.is_chain)
    method, type_pattern = parse_method(args.method)
    result = partition_graph(
        graph,
        args.stages,
        method=method,
        type_pattern=type_pattern,
        boundaries=parse_cuts(args.boundaries) if args.boundaries is not None else None,
        memory_cap=parse_bytes(args.memory_cap) if args.memory_cap is not None else None,
        speeds=_speeds(args.speeds) if args.speeds is not None else None,
        num_microbatches=args.microbatches,
        schedule_memory=parse_schedule_memory(args.schedule),
        bandwidth=parse_bytes(args.bandwidth) if args.bandwidth is not None else None,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, allow_nan=False))  # strict JSON only
    else:
        print(result.format_table())
    if args.plot:
        from viz import plot_partition  # matplotlib loads only when plotting

        cuts = result.boundaries
        plot_partition(result.compute, result.comm, result.memory, memory_cap=result.memory_cap,
                       names=[f"layers {a}-{b - 1}" for a, b in pairwise(cuts)],
                       unit="s", path=args.plot,
                       title=f"{result.method.value} partition of {result.num_layers} layers into "
                             f"{result.num_stages} stages")
        print(f"pipesched partition: wrote {args.plot}", file=sys.stderr)
    return 0
