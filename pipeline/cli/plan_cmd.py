"""`pipesched plan`: the fastest pp × tp × dp × ZeRO × schedule × microbatching that fits."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipeline.cli.options import positive_int
from pipeline.cli.output_paths import figure_path

__all__ = ["register", "run"]

_DESCRIPTION = """\
Search every pipeline × tensor × data-parallel grid, ZeRO stage, schedule, chunk count,
microbatch size and activation recomputation for MODEL on CLUSTER; prune by memory, place
layers with the exact partitioner, simulate each schedule, and rank by predicted step time.

MODEL: a transformer shape (layers=,hidden=,heads=,vocab=,seq=[,ffn=,kv_heads=]), a JSON
file with those keys, or a partitioner cost JSON (times per --cost-batch samples).
CLUSTER: a100-80g, h100-80g, a800-80g (8 devices a node; --nodes sets how many nodes),
local (this machine, calibrated in a few seconds), or a JSON file (see NOTES / README).
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "plan", help="find the fastest parallel configuration for a model on a cluster",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="MODEL")
    parser.add_argument("--cluster", required=True, metavar="CLUSTER")
    parser.add_argument("--global-batch", type=positive_int, required=True, metavar="B",
                        help="samples (sequences) per optimizer step, all replicas together")
    parser.add_argument("--seq", type=positive_int, default=None, metavar="S",
                        help="sequence length (overrides the shape's seq)")
    parser.add_argument("--nodes", type=positive_int, default=None, metavar="N",
                        help="nodes of the cluster (presets: 1)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                        help="compute precision (default: the cluster's; local: fp32)")
    parser.add_argument("--schedules", default=None, metavar="NAMES",
                        help="comma-separated schedules to consider (default: all training ones)")
    parser.add_argument("--tensor-parallel", default=None, metavar="SIZES",
                        help="comma-separated tp sizes (default: divisors of the devices per "
                             "node that divide the heads)")
    parser.add_argument("--no-recompute", action="store_true",
                        help="never consider activation recomputation")
    parser.add_argument("--cost-batch", type=positive_int, default=1, metavar="N",
                        help="samples per microbatch the cost JSON's times were measured at")
    parser.add_argument("--top", type=positive_int, default=10, metavar="K",
                        help="rows of the ranked table (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", type=figure_path, metavar="FILE",
                        help="save step time against memory per rank (.png or .svg)")
    parser.set_defaults(func=run)


def _names(text: str | None, what: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(item.strip() for item in text.split(",") if item.strip())
    if not names:
        raise ValueError(f"--{what} {text!r} names nothing; give a comma-separated list")
    return names


def _sizes(text: str | None) -> tuple[int, ...] | None:
    names = _names(text, "tensor-parallel")
    if names is None:
        return None
    try:
        sizes = tuple(int(name) for name in names)
    except ValueError:
        raise ValueError(f"--tensor-parallel {text!r} must be whole numbers, e.g. 1,2,4") \
            from None
    if any(size < 1 for size in sizes):
        raise ValueError(f"--tensor-parallel {text!r} must be whole numbers >= 1")
    return sizes


def run(args: argparse.Namespace) -> int:
    from pipeline.planner import SearchOptions, load_model, plan, resolve_cluster
    from pipeline.planner.limits import (
        MAX_DEVICES,
        MAX_GLOBAL_BATCH,
        check_plan_work,
        divisors,
    )
    from pipeline.planner.report import format_table, plan_document, plot_plan

    if (args.nodes is not None and args.nodes > MAX_DEVICES) or \
            args.global_batch > MAX_GLOBAL_BATCH:  # before a cluster is calibrated
        check_plan_work(1, args.nodes or 1, 1, (1,), args.global_batch, (), 1)
    cluster = resolve_cluster(args.cluster, nodes=args.nodes)
    precision = args.precision or cluster.precision
    model = load_model(args.model, seq=args.seq, precision=precision,
                       cost_batch=args.cost_batch)
    defaults = SearchOptions()
    options = SearchOptions(schedules=_names(args.schedules, "schedules") or defaults.schedules,
                            recompute=not args.no_recompute,
                            tensor_parallel=_sizes(args.tensor_parallel), top=args.top)
    tensor_parallel = options.tensor_parallel or (
        divisors(cluster.devices_per_node) if model.tensor_parallel_ok else (1,))
    check_plan_work(len(model.layers), cluster.nodes, cluster.devices_per_node, tensor_parallel,
                    args.global_batch, options.schedules, options.max_chunks)
    result = plan(model, cluster, args.global_batch, precision=precision, options=options)
    if args.json:
        print(json.dumps(plan_document(result, cluster, args.global_batch, top=args.top)))
    else:
        print(f"{model.name} on {cluster.num_devices} × {cluster.name} ({precision}), "
              f"global batch {args.global_batch}\n")
        print(format_table(result, cluster, args.global_batch, top=args.top))
    if args.plot:
        plot_plan(result, cluster, args.plot)
        print(f"pipesched plan: wrote {args.plot}", file=sys.stderr)
    return 0
