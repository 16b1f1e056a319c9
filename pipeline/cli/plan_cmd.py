"""`pipesched plan`: the fastest pp × tp × dp × ZeRO × schedule × microbatching that fits."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any

from pipeline.cli.options import non_negative_float, positive_float, positive_int
from pipeline.cli.output_paths import figure_path
from pipeline.cli.price_config import parse_config
from pipeline.files import InputFileType
from pipeline.limits import MAX_COUNT, MAX_INPUT_BYTES

__all__ = ["register", "run"]

_DESCRIPTION = """\
Search every pipeline × tensor × data-parallel grid, ZeRO stage, schedule, chunk count,
microbatch size and activation recomputation for MODEL on CLUSTER; prune by memory, place
layers with the exact partitioner, simulate each schedule, and rank by predicted step time.

MODEL: a transformer shape (layers=,hidden=,heads=,vocab=,seq=[,ffn=,kv_heads=,head_dim=,
mlp=gelu|swiglu|geglu,norm=layernorm|rmsnorm,bias=all|qkv|none,tied_embeddings=true,
learned_positions=false,...]), a JSON file with those keys, a Hugging Face config.json or
model directory (GPT-2, Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, and the mixtures of
experts Mixtral, Qwen2-MoE, Qwen3-MoE; --seq defaults to its max_position_embeddings), or a
partitioner cost JSON (times per --cost-batch samples). A mixture of experts as a shape:
experts=,topk=,expert_ffn=[,shared_ffn=,shared_gate=true,sparse_step=,dense_layers=0;5,
expert_groups=,topk_groups= (group-limited routing: k experts from M of G groups)];
the search then tries every expert-parallel size ep (--ep) dividing dp and the experts,
beside tp > 1 with --sequence-parallel (experts whole on each tp rank, split over ep).
CLUSTER: a100-80g, h100-80g, a800-80g (8 devices a node; --nodes sets how many nodes),
local (this machine, calibrated in a few seconds), or a JSON file (see CLUSTER FILES below).
"""

_EPILOG = """\
CLUSTER FILES
  A JSON object with the fields of pipeline.planner.ClusterSpec, e.g.
    {"preset": "a100-80g", "nodes": 16, "nic_bandwidth": 12.5e9}
  "preset" starts from a preset and overrides the fields given. Without one, give at least
  nodes, devices_per_node, device_memory (bytes), peak_flops ({"bf16": FLOP/s}),
  achieved_fraction, intra_bandwidth, intra_latency, inter_bandwidth, inter_latency,
  memory_bandwidth (bytes/s, seconds). Device model (optional): sm_count, gemm_efficiency,
  memory_efficiency, kernel_overhead, host_op_seconds (host seconds to issue an op; 0 off,
  as for a CUDA-graphed step), nics_per_node, nic_bandwidth, link_efficiency,
  nccl_arch ("ampere" or "hopper": collectives priced by NCCL's own cost model with that
  architecture's tables, as the presets; "": alpha-beta at link_efficiency),
  gemm_epilogue_serial (true: each GEMM stores its output after its k-loop, as Ampere's
  kernels do; the A100 presets); or measure it: pipesched profile-device --output
  dev.json, then --device-profile dev.json. Runtime memory (optional): compute_capability
  (80, 90: prices torch's cuBLAS workspaces and NCCL's buffers; 0, the default without a
  preset: none), nvlink_links (NCCL's channels in a node), memory_margin (bytes kept free).

ENGINES
  --engine megatron-2021 prices what Megatron-LM of 2021 could run and how it ran it
  (pipeline.planner.engines.MEGATRON_LM_2021); add --precision fp16 --attention eager to
  price it as the paper ran (benchmarks/bench_plan.py --part published).
  --engine megatron-core: Megatron-Core as its current scripts run it (MEGATRON_CORE:
  sequence parallelism and --tp-comm-overlap, distributed optimizer, overlapped gradient
  reduce-scatter and parameter all-gather, 1F1B or interleaved, every recomputation mode).
  --engine deepspeed: DeepSpeed's pipeline engine (DEEPSPEED: 1F1B, ZeRO-0/1, full
  recomputation or none, the all-reduce after the pipeline, blocking P2P).
  Filters may narrow an engine's schedules, ZeRO stages and recomputation modes, not widen
  them. The pick is printed as that engine's command line; for a HF --model on pipesched,
  the torchrun line and the Python entry that trains it. A HF --model's blocks on pipesched
  are priced as HF's eager modules keep activations (Llama, Mistral, Qwen2, GPT-2:
  pipeline.planner.hf_activations); other families and engines as Megatron's fused layer
  (Korthikanti et al. 2022), the model's name saying which.

PRICING ONE CONFIGURATION
  --price pp4,tp2,dp8,1f1b,b1 prints one configuration's full breakdown. Items: ppN, tpN,
  dpN (two of the three are enough), bN (microbatch size, default 1), a schedule name
  (default 1f1b), vN (chunks per rank), z0/z1 (ZeRO stage), rc (full recomputation), epN
  (expert parallelism of a mixture-of-experts model, dividing dp and the experts), cpN
  (context parallelism: pp · tp · dp · cp are the devices).
"""


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "plan", help="find the fastest parallel configuration for a model on a cluster",
        description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="MODEL",
                        type=InputFileType(MAX_INPUT_BYTES, json_document=True, or_text=True,
                                           directory_file="config.json"))
    parser.add_argument("--cluster", required=True, metavar="CLUSTER",
                        type=InputFileType(MAX_INPUT_BYTES, json_document=True, or_text=True))
    parser.add_argument("--global-batch", type=positive_int, required=True, metavar="B",
                        help="samples (sequences) per optimizer step, all replicas together")
    parser.add_argument("--seq", type=positive_int, default=None, metavar="S",
                        help="sequence length (overrides the shape's seq)")
    parser.add_argument("--nodes", type=positive_int, default=None, metavar="N",
                        help="nodes of the cluster (presets: 1)")
    parser.add_argument("--memory-margin", type=non_negative_float, default=0.0,
                        metavar="GIB",
                        help="GiB per device to keep free besides what the plan prices (the "
                             "CUDA context, the allocator's fragmentation); default 0")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32", "fp8"), default=None,
                        help="compute precision (default: the cluster's; local: fp32); fp8 "
                             "is refused: outside the search's space")
    parser.add_argument("--context-parallel", type=positive_int, default=1, metavar="N",
                        help="context parallelism: search every cp up to N that divides the "
                             "devices and cuts the sequence into 2·cp chunks (default 1: "
                             "none); --engine pipesched and megatron-core (see "
                             "--cp-comm-type)")
    parser.add_argument("--cp-comm-type", choices=("p2p", "a2a", "allgather"), default=None,
                        help="--engine megatron-core only: how its context parallelism moves "
                             "K/V (Megatron-Core's --cp-comm-type): p2p (default: the ring, "
                             "overlapped with the attention), a2a (Q, K, V, O all-to-all, "
                             "exposed; tp · cp must divide the heads and K/V heads) or "
                             "allgather (K/V "
                             "all-gathered, exposed)")
    parser.add_argument("--cp", default=None, metavar="SIZES",
                        help="comma-separated context-parallel sizes to consider (each must "
                             "divide the devices, 2·cp the sequence)")
    parser.add_argument("--fsdp", action="store_true",
                        help="fully sharded data parallelism: searched as ZeRO-3 "
                             "(= --zero 3)")
    parser.add_argument("--schedules", default=None, metavar="NAMES",
                        help="comma-separated schedules to consider (default: all training ones)")
    parser.add_argument("--tensor-parallel", default=None, metavar="SIZES",
                        help="comma-separated tp sizes (default: divisors of the devices per "
                             "node that divide the heads)")
    parser.add_argument("--pp", default=None, metavar="SIZES",
                        help="comma-separated pipeline sizes to consider")
    parser.add_argument("--tp", default=None, metavar="SIZES",
                        help="comma-separated tensor-parallel sizes (= --tensor-parallel)")
    parser.add_argument("--dp", default=None, metavar="SIZES",
                        help="comma-separated data-parallel sizes to consider")
    parser.add_argument("--ep", default=None, metavar="SIZES",
                        help="comma-separated expert-parallel sizes for a mixture-of-experts "
                             "model (default: every divisor of dp that divides the experts)")
    parser.add_argument("--microbatch-size", default=None, metavar="SIZES",
                        help="comma-separated microbatch sizes (samples) to consider")
    parser.add_argument("--zero", default=None, metavar="STAGES",
                        help="ZeRO stages to consider, comma-separated among 0,1,2,3 "
                             "(default 0,1; 2 and 3 shard gradients and weights too, at m "
                             "collectives a step)")
    parser.add_argument("--recompute", default=None, metavar="MODES",
                        help="activation recomputation to consider, comma-separated: none, "
                             "selective (attention's core), full (whole layers), partial "
                             "(full on the first k layers of each stage); default all four")
    parser.add_argument("--no-recompute", action="store_true",
                        help="never consider activation recomputation (= --recompute none)")
    parser.add_argument("--attention", choices=("fused", "eager"), default="fused",
                        help="attention kernels of a transformer shape: fused (FlashAttention, "
                             "no s×s scores; default) or eager")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="tensor parallelism with sequence parallelism (norms, dropout and "
                             "their activations split over tp)")
    parser.add_argument("--tp-comm-overlap", action="store_true",
                        help="price the blocks' tensor-parallel collectives beside their GEMMs "
                             "(the engine's ParallelTransformerBlock(overlap=True), a HF "
                             "model's tensor_parallel_hf(hf, overlap=True); default: exposed "
                             "whole); --engine pipesched only")
    parser.add_argument("--two-batch-overlap", action="store_true",
                        help="price MoE configurations (ep > 1, microbatches of 2 or more "
                             "samples) with the engine's two_batch_overlap: forwards outside "
                             "F&B pairs as two halves taking turns at their all-to-alls "
                             "(default: exposed); --engine pipesched only")
    parser.add_argument("--expert-tensor-parallel", action="store_true",
                        help="split each MoE expert over the tp group too (expert tensor "
                             "parallelism = tp: train --expert-tensor-parallel, Megatron-Core's "
                             "--expert-tensor-parallel-size); default: whole on its ep rank")
    parser.add_argument("--moe-dispatcher", choices=("alltoall", "deepep"), default=None,
                        help="how a MoE plan's tokens reach their experts: alltoall (one "
                             "copy per token and expert; the engines' default) or deepep "
                             "(one copy per destination node, forwarded over NVLink there: "
                             "Megatron-Core's flex dispatcher; --engine megatron-core)")
    parser.add_argument("--routing-imbalance", type=positive_float, default=None, metavar="FACTOR",
                        help="MoE: the busiest expert-parallel rank's routed tokens over the "
                             "mean, as measured on your runs (>= 1, e.g. 1.2); the expert "
                             "GEMMs and all-to-all are priced at it (default: the sampling "
                             "floor of a balanced router)")
    parser.add_argument("--overlap-param-gather", action="store_true",
                        help="price ZeRO-1's parameter all-gather overlapped with the next "
                             "step's forwards (the engine's overlap_param_gather; default: "
                             "exposed after the step, the engine's default)")
    parser.add_argument("--engine", choices=("pipesched", "megatron-2021", "megatron-core",
                                             "deepspeed"), default="pipesched",
                        help="the training engine priced: pipesched (default), megatron-2021 "
                             "(Megatron-LM as its SC'21 paper ran it), megatron-core (its "
                             "current scripts: distributed optimizer, sequence parallelism, "
                             "--tp-comm-overlap) or deepspeed (its pipeline engine: 1F1B, "
                             "ZeRO-0/1); see ENGINES below")
    parser.add_argument("--device-profile", default=None, metavar="FILE",
                        type=InputFileType(MAX_INPUT_BYTES, json_document=True),
                        help="price GEMMs and links from `pipesched profile-device` output")
    parser.add_argument("--price", default=None, metavar="CONFIG",
                        help="price one configuration, e.g. pp4,tp1,dp16,1f1b,b1 (see below)")
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


def _sizes(text: str | None, what: str = "tensor-parallel") -> tuple[int, ...] | None:
    names = _names(text, what)
    if names is None:
        return None
    try:
        sizes = tuple(int(name) for name in names)
    except ValueError:
        raise ValueError(f"--{what} {text!r} must be whole numbers, e.g. 1,2,4") from None
    if any(not 1 <= size <= MAX_COUNT for size in sizes):
        raise ValueError(f"--{what} {str(text)[:60]!r} must be whole numbers in "
                         f"1..{MAX_COUNT:,}")
    return sizes


def _zero_stages(text: str | None, fsdp: bool) -> tuple[int, ...] | None:
    """The --zero stages; --fsdp (fully sharded data parallelism) is ZeRO-3."""
    names = _names(text, "zero")
    if fsdp and names is not None and "3" not in names:
        raise ValueError(f"--fsdp is ZeRO-3, but --zero {text} leaves 3 out: add 3 to --zero "
                         f"or drop --fsdp")
    if names is None:
        return (3,) if fsdp else None
    if any(name not in ("0", "1", "2", "3") for name in names):
        raise ValueError(f"--zero {text}: ZeRO stages are 0, 1, 2 and 3 (e.g. --zero 0,1,2,3)")
    return tuple(int(name) for name in names)


def _recompute(args: argparse.Namespace) -> tuple[str, ...] | None:
    from pipeline.planner.search import RECOMPUTE_CHOICES

    names = _names(args.recompute, "recompute")
    if names is None:
        return ("none",) if args.no_recompute else None
    unknown = [name for name in names if name not in RECOMPUTE_CHOICES]
    if unknown:
        raise ValueError(f"--recompute {args.recompute!r}: {', '.join(unknown)} unknown; "
                         f"use some of {','.join(RECOMPUTE_CHOICES)}")
    if args.no_recompute and set(names) - {"none"}:
        raise ValueError(f"--no-recompute contradicts --recompute {args.recompute}; give one "
                         f"of them")
    return tuple(dict.fromkeys(names))


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
        args.engine, schedules=_names(args.schedules, "schedules"),
        tensor_parallel=_sizes(args.tp or args.tensor_parallel, tp_flag),
        pipeline_parallel=_sizes(args.pp, "pp"), data_parallel=_sizes(args.dp, "dp"),
        expert_parallel=_sizes(args.ep, "ep"),
        microbatch_sizes=_sizes(args.microbatch_size, "microbatch-size"),
        zero_stages=_zero_stages(args.zero, args.fsdp), recompute_choices=_recompute(args),
        top=args.top,
        overlap_param_gather=args.overlap_param_gather or None, tp_overlap=tp_overlap,
        two_batch_overlap=halves, moe_dispatcher=args.moe_dispatcher,
        routing_imbalance=args.routing_imbalance,
        expert_tensor_parallel=args.expert_tensor_parallel or None,
        cp_attention=cp_attention),
        context_parallel=context_sizes(
            _sizes(args.cp, "cp"), args.context_parallel, model.seq, cluster.num_devices))
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
