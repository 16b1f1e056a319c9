"""`pipesched plan`'s parser: every flag with its help, the description and the epilog."""

from __future__ import annotations

import argparse
from typing import Any

from pipeline.cli.options import non_negative_float, positive_float, positive_int
from pipeline.cli.output_paths import figure_path
from pipeline.files import InputFileType
from pipeline.limits import MAX_INPUT_BYTES

__all__ = ["add_plan_parser"]

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


def add_plan_parser(subparsers: argparse._SubParsersAction[Any]) -> argparse.ArgumentParser:
    """Add the `plan` subcommand with all its flags to `subparsers`; return its parser."""
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
    return parser
