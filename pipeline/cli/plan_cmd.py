"""`pipesched plan`: the fastest pp × tp × dp × ZeRO × schedule × microbatching that fits."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from pipeline.cli.plan_arguments import add_plan_parser
from pipeline.cli.plan_filters import (
    parse_names,
    parse_recompute,
    parse_sizes,
    parse_zero_stages,
)
from pipeline.cli.price_config import parse_config

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    add_plan_parser(subparsers).set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipeline.planner import SearchOptions, load_model, plan, resolve_cluster
    from pipeline.planner.context_choice import context_sizes, why_context_parallel
    from pipeline.planner.context_comm import CP_COMM_TYPES
    from pipeline.planner.engines import ENGINE_PROFILES, engine_options, outside_space
    from pipeline.planner.hf_config import hf_model_type
    from pipeline.planner.launch import LaunchTarget, hf_source
    from pipeline.planner.limits import (
        MAX_DEVICES,
        MAX_GLOBAL_BATCH,
        check_plan_work,
        divisors,
    )
    from pipeline.planner.report import format_breakdown, format_table, plan_document, plot_plan
    from pipeline.planner.search import price
    from pipeline.planner.stages import block_span

    cp_asked = args.context_parallel > 1 or args.cp is not None
    for asked, feature, name in ((args.precision == "fp8", "--precision fp8", "FP8"),
                                 (cp_asked and args.engine not in ("pipesched",
                                                                   "megatron-core"),
                                  f"--context-parallel {args.context_parallel}",
                                  "context parallelism")):
        if asked:
            raise outside_space(feature, name)
    if args.cp_comm_type is not None and args.engine != "megatron-core":
        raise ValueError(f"--cp-comm-type {args.cp_comm_type} is Megatron-Core's; --engine "
                         f"{args.engine} moves its own K/V (pipesched: all-gathered); drop "
                         f"--cp-comm-type or use --engine megatron-core")
    cp_attention = CP_COMM_TYPES[args.cp_comm_type] if args.cp_comm_type else None
    if (args.nodes is not None and args.nodes > MAX_DEVICES) or \
            args.global_batch > MAX_GLOBAL_BATCH:  # before a cluster is calibrated
        check_plan_work(1, args.nodes or 1, 1, (1,), args.global_batch, (), 1)
    if args.tp_comm_overlap and args.engine != "pipesched":
        raise ValueError(f"--tp-comm-overlap prices pipesched's overlapped tensor-parallel "
                         f"layers, not --engine {args.engine}'s "
                         + ("(megatron-core prices its own --tp-comm-overlap already)"
                            if args.engine == "megatron-core" else "(it runs none)")
                         + "; drop --tp-comm-overlap")
    tp_overlap = "pipesched" if args.tp_comm_overlap else None
    if args.two_batch_overlap and args.engine != "pipesched":
        raise ValueError(f"--two-batch-overlap is this engine's; {args.engine} runs no "
                         "two-batch overlap; drop --two-batch-overlap")
    halves = args.two_batch_overlap or None
    # the model read once before the cluster: a local cluster calibrates on ranks for
    # seconds, and a misspelt --model must be refused before that (its precision is the
    # cluster's, so the model is read again below)
    load_model(args.model, seq=args.seq, precision=args.precision or "bf16",
               cost_batch=args.cost_batch, attention=args.attention)
    cluster = resolve_cluster(args.cluster, nodes=args.nodes)
    if args.memory_margin:
        cluster = replace(cluster, memory_margin=args.memory_margin * 2**30)
    if args.device_profile:
        from pipeline.planner.device_profile import apply_device_profile

        cluster = apply_device_profile(cluster, args.device_profile)
    precision = args.precision or cluster.precision
    profile = dict(ENGINE_PROFILES.get(args.engine, {}))
    model = load_model(args.model, seq=args.seq, precision=precision,
                       cost_batch=args.cost_batch, attention=args.attention,
                       sequence_parallel=args.sequence_parallel
                       or profile.get("sequence_parallel", False),
                       engine=profile.get("engine", "pipesched"),
                       hf_eager=args.engine == "pipesched")
    first, end = block_span(model.layers)
    family = hf_model_type(args.model)
    target = LaunchTarget(engine=args.engine, blocks=end - first,
                          hf=hf_source(args.model, family) if family else None,
                          nodes=cluster.nodes, devices_per_node=cluster.devices_per_node,
                          seq=model.seq, sequence_parallel=args.sequence_parallel,
                          tp_comm_overlap=args.tp_comm_overlap,
                          two_batch_overlap=args.two_batch_overlap,
                          expert_tensor_parallel=args.expert_tensor_parallel,
                          experts=model.experts,
                          moe_dispatcher=args.moe_dispatcher or "alltoall",
                          cp_comm_type=args.cp_comm_type or "p2p",
                          expert_groups=(model.routing.groups, model.routing.top_groups)
                          if model.routing is not None else (1, 1))
    launch: dict[str, Any] = {"engine": args.engine, "blocks": end - first, "target": target}
    header = (f"{model.name} on {cluster.num_devices} × {cluster.name} ({precision}), "
              f"global batch {args.global_batch}\n")
    if args.price:
        config = parse_config(args.price, cluster.num_devices, args.global_batch)
        if config.cp > 1 and args.engine not in ("pipesched", "megatron-core"):
            raise outside_space(f"--price {args.price}", "context parallelism")
        engine = engine_options(args.engine, overlap_param_gather=args.overlap_param_gather
                                or None, tp_overlap=tp_overlap, two_batch_overlap=halves,
                                moe_dispatcher=args.moe_dispatcher,
                                routing_imbalance=args.routing_imbalance,
                                expert_tensor_parallel=args.expert_tensor_parallel or None,
                                cp_attention=cp_attention)
        prediction = price(model, cluster, args.global_batch, config, precision=precision,
                           options=SearchOptions(**engine))
        if args.json:
            print(json.dumps(prediction.to_dict()))
        else:
            print(header)
            print(format_breakdown(prediction, cluster, args.global_batch, **launch))
        return 0
    if args.tp is not None and args.tensor_parallel is not None:
        raise ValueError("--tp and --tensor-parallel are the same filter; give one")
    tp_flag = "tp" if args.tp is not None else "tensor-parallel"
    options = SearchOptions(**engine_options(
        args.engine, schedules=parse_names(args.schedules, "schedules"),
        tensor_parallel=parse_sizes(args.tp or args.tensor_parallel, tp_flag),
        pipeline_parallel=parse_sizes(args.pp, "pp"), data_parallel=parse_sizes(args.dp, "dp"),
        expert_parallel=parse_sizes(args.ep, "ep"),
        microbatch_sizes=parse_sizes(args.microbatch_size, "microbatch-size"),
        zero_stages=parse_zero_stages(args.zero, args.fsdp),
        recompute_choices=parse_recompute(args), top=args.top,
        overlap_param_gather=args.overlap_param_gather or None, tp_overlap=tp_overlap,
        two_batch_overlap=halves, moe_dispatcher=args.moe_dispatcher,
        routing_imbalance=args.routing_imbalance,
        expert_tensor_parallel=args.expert_tensor_parallel or None,
        cp_attention=cp_attention),
        context_parallel=context_sizes(
            parse_sizes(args.cp, "cp"), args.context_parallel, model.seq, cluster.num_devices))
    tensor_parallel = options.tensor_parallel or (
        divisors(cluster.devices_per_node) if model.tensor_parallel_ok else (1,))
    check_plan_work(len(model.layers), cluster.nodes, cluster.devices_per_node, tensor_parallel,
                    args.global_batch, options.schedules, options.max_chunks)
    result = plan(model, cluster, args.global_batch, precision=precision, options=options)
    if args.json:
        print(json.dumps(plan_document(result, cluster, args.global_batch, top=args.top,
                                        **launch)))
    else:
        print(header)
        print(format_table(result, cluster, args.global_batch, top=args.top, **launch))
        if result.best.config.cp > 1:
            print(why_context_parallel(result.best.config.cp, model, cluster,
                                       args.global_batch, precision, options))
    if args.plot:
        plot_plan(result, cluster, args.plot, top=args.top)
        print(f"pipesched plan: wrote {args.plot}", file=sys.stderr)
    return 0
