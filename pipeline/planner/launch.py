"""How to run a plan's pick on each engine: the launcher line (torchrun, deepspeed) and the
Python entry or script arguments, tensor parallelism included."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass
from typing import Any

from pipeline.planner.config import PlanConfig

__all__ = ["HFSource", "LaunchTarget", "hf_source", "launch_lines", "run_arguments"]


@dataclass(frozen=True)
class HFSource:
    """A HF model the plan was made for: its directory (config.json, safetensors) and how
    many of `layers_from_hf`'s layers come before its blocks (GPT-2: wte and wpe, 2; the
    others: the embedding, 1); after them come the final norm and the LM head."""

    directory: str
    leading: int = 1


@dataclass(frozen=True, kw_only=True)
class LaunchTarget:
    """Where the pick will run: the engine, the model's transformer blocks, its HF source (if
    any), the cluster's shape and the tensor-parallel options the plan priced."""

    engine: str = "pipesched"
    blocks: int = 0
    hf: HFSource | None = None
    nodes: int = 1
    devices_per_node: int = 1
    seq: int = 0
    """The sequence length priced (the run's --seq-len; 0: not known)."""
    sequence_parallel: bool = False
    """Priced with sequence parallelism (`pipesched plan --sequence-parallel`)."""
    tp_comm_overlap: bool = False
    """Priced with this engine's overlapped tp collectives (`pipesched plan
    --tp-comm-overlap`)."""
    two_batch_overlap: bool = False
    """Priced with two-batch overlap (`pipesched plan --two-batch-overlap`): the engine line
    of an MoE pick whose microbatches can be halved turns it on."""
    expert_tensor_parallel: bool = False
    """Priced with each expert split over tp (`pipesched plan --expert-tensor-parallel`)."""
    experts: int = 0
    """The model's routed experts per MoE layer (0: dense)."""
    moe_dispatcher: str = "alltoall"
    """The token dispatcher priced (`SearchOptions.moe_dispatcher`)."""
    expert_groups: tuple[int, int] = (1, 1)
    """(G, M): the model's group-limited routing, G groups, M a token (1, 1: none)."""
    cp_comm_type: str = "p2p"
    """Megatron-Core's --cp-comm-type priced (`context_comm.CP_COMM_TYPES`)."""


def _expert_tp(config: PlanConfig, target: LaunchTarget) -> int:
    """The expert tensor parallelism priced: tp with `expert_tensor_parallel`, else 1."""
    return config.tp if target.expert_tensor_parallel and target.experts else 1


def _torchrun(target: LaunchTarget, script: str) -> str:
    """torchrun's line: one node rendezvouses on its own (``--standalone``); many nodes meet
    at the head node, a placeholder the caller sets (`_HEAD_NODE_NOTE`)."""
    if target.nodes == 1:
        return f"torchrun --standalone --nproc-per-node {target.devices_per_node} {script}"
    return (f"torchrun --nnodes {target.nodes} --nproc-per-node {target.devices_per_node} "
            f"--rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 {script}")


_HEAD_NODE_NOTE = ("  run it on each node with HEAD_NODE set to the host name of one of them "
                   "(the same on all: torchrun's rendezvous, port 29500)")
_RUN_NOTE = ("  set DATA to a token file (uint16 or uint32 ids back to back, e.g. nanoGPT's "
             "train.bin; its dtype in DATA.json: {\"dtype\": \"uint16\"}), STEPS to the "
             "steps to train and CHECKPOINT_DIR to a directory (a checkpoint every 100 steps "
             "and at the end, metrics.jsonl; the same command resumes from its latest)")


def run_arguments(config: PlanConfig, global_batch: int, target: LaunchTarget,
                  boundaries: tuple[int, ...]) -> dict[str, Any]:
    """`pipesched run`'s options for `config` on a HF model (argparse names, the JSON
    `pipesched plan --json` writes under ``pick.run_arguments``)."""
    assert target.hf is not None
    arguments: dict[str, Any] = {
        "stages": config.pp, "chunks": config.chunks, "data_parallel": config.dp,
        "tp": config.tp, "schedule": config.schedule,
        "microbatches": config.num_microbatches, "batch_size": global_batch,
        "partition": ",".join(map(str, _hf_cuts(boundaries, target.blocks,
                                                target.hf.leading)))}
    if target.seq:
        arguments["seq_len"] = target.seq
    if config.zero_stage:
        arguments["zero"] = config.zero_stage
    if config.recompute != "none":
        arguments["recompute"] = config.recompute
        if config.recompute_layers:
            arguments["recompute_layers"] = config.recompute_layers
    if config.tp > 1:
        arguments |= {"sequence_parallel": target.sequence_parallel,
                      "tp_comm_overlap": target.tp_comm_overlap}
    return arguments


def _run_command(config: PlanConfig, global_batch: int, target: LaunchTarget,
                 boundaries: tuple[int, ...]) -> list[str]:
    """The torchrun line that runs `pipesched run` on this pick, and what to set first."""
    assert target.hf is not None
    flags = [f"--model {shlex.quote(target.hf.directory)} --data $DATA --steps $STEPS "
             f"--checkpoint $CHECKPOINT_DIR --metrics $CHECKPOINT_DIR/metrics.jsonl"]
    for name, value in run_arguments(config, global_batch, target, boundaries).items():
        flag = "--zero-stage" if name == "zero" else "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags.append(f"{flag} {value}")
    lines = [_torchrun(target, "-m pipeline.cli run " + " ".join(flags)), _RUN_NOTE]
    return lines + ([_HEAD_NODE_NOTE] if target.nodes > 1 else [])


def _hf_cuts(boundaries: tuple[int, ...], blocks: int, leading: int) -> list[int]:
    """The planner's stage cuts (over embedding, blocks, head) as `layers_from_hf`'s layer
    indices (over `leading` embedding layers, the blocks, the final norm and the head)."""
    end = leading + blocks + 2

    def one(cut: int) -> int:
        if cut == 0:
            return 0
        return end if cut == blocks + 2 else cut - 1 + leading

    return [one(cut) for cut in boundaries]


def _pipesched(config: PlanConfig, global_batch: int, target: LaunchTarget, blocks: int,
               boundaries: tuple[int, ...]) -> list[str]:
    arguments = config.engine_arguments()
    halves = target.two_batch_overlap and config.ep > 1 and config.microbatch_size >= 2
    if halves:
        arguments["two_batch_overlap"] = True
    etp = _expert_tp(config, target)
    if etp > 1:
        arguments["expert_tensor_parallel"] = etp
    if target.hf is None:
        text = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
        return [f"PipelineModule/PipelineEngine: {text}",
                config.train_command(global_batch, etp),
                _torchrun(target, "your_script.py") + "   # one process per device"]
    if config.ep == 1 and config.cp == 1:  # dense, whole sequences: `pipesched run` trains it
        return _run_command(config, global_batch, target, boundaries)
    source = target.hf.directory
    module = (f"num_stages={config.pp}, chunks={config.chunks}, loss_fn=hf.loss_fn, "
              f"partition_method={_hf_cuts(boundaries, blocks, target.hf.leading)}, "
              f"recompute={config.recompute!r}"
              + (f", recompute_layers={config.recompute_layers}"
                 if config.recompute_layers else ""))
    engine = (f"schedule={config.schedule!r}, num_microbatches={config.num_microbatches}, "
              f"data_parallel={config.dp}, tensor_parallel={config.tp}, "
              f"zero_stage={config.zero_stage}"
              + (f", expert_parallel={config.ep}" if config.ep > 1 else "")
              + (f", context_parallel={config.cp}" if config.cp > 1 else "")
              + (", two_batch_overlap=True" if halves else "")
              + (f", expert_tensor_parallel={etp}" if etp > 1 else ""))
    experts = f", expert_parallel={config.ep}" if config.ep > 1 else ""
    per_replica = global_batch // config.dp
    options = "".join(f", {name}=True" for name, on in (
        ("sequence_parallel", target.sequence_parallel), ("overlap", target.tp_comm_overlap))
        if on)
    split = (["  from pipeline.interop.hf_tensor_parallel import tensor_parallel_hf",
              f"  hf = tensor_parallel_hf(hf{options})   # each tp rank keeps its slice of "
              "every layer"] if config.tp > 1 else [])
    return [_torchrun(target, "train_hf.py"),
            "train_hf.py (the Python entry, on every rank):",
            "  import torch, transformers",
            "  from pipeline import PipelineEngine, PipelineModule",
            "  from pipeline.interop.hf_layers import causal_lm_targets, layers_from_hf",
            "  from pipeline.interop.hf_weights import load_hf_weights",
            f"  hf = layers_from_hf(transformers.AutoConfig.from_pretrained({source!r})"
            f"{experts})",
            *split,
            *(["  from pipeline.interop.hf_context_parallel import context_parallel_hf",
               "  hf = context_parallel_hf(hf)   # last: each cp rank keeps 2 of 2·cp "
               "sequence chunks"] if config.cp > 1 else []),
            f"  module = PipelineModule(hf.layers, {module})",
            f"  load_hf_weights(module, hf, {source!r})",
            f"  engine = PipelineEngine(module, {engine}, "
            "optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))",
            f"  loss = engine.train_batch(ids, causal_lm_targets(ids))   # ids: this "
            f"replica's {per_replica} sequences (dp rank engine.position.dp_rank)"]


def _recompute_flags(config: PlanConfig) -> list[str]:
    """Megatron-Core's recomputation flags (`arguments.py`)."""
    if config.recompute == "selective":
        return ["--recompute-granularity selective"]
    if config.recompute == "full":
        if config.recompute_layers:
            return ["--recompute-granularity full --recompute-method block "
                    f"--recompute-num-layers {config.recompute_layers}"]
        return ["--recompute-granularity full --recompute-method uniform "
                "--recompute-num-layers 1"]
    return []


def _megatron_parallel_flags(config: PlanConfig, global_batch: int, blocks: int) -> list[str]:
    """The parallel sizes, batch and interleaving flags both Megatron engines share."""
    flags = [f"--tensor-model-parallel-size {config.tp}",
             f"--pipeline-model-parallel-size {config.pp}",
             f"--micro-batch-size {config.microbatch_size}",
             f"--global-batch-size {global_batch}"]
    if config.schedule == "interleaved":
        flags.append(f"--num-layers-per-virtual-pipeline-stage "
                     f"{blocks // (config.pp * config.chunks)}")
    return flags


def _megatron_core(config: PlanConfig, global_batch: int, target: LaunchTarget,
                   blocks: int) -> list[str]:
    flags = _megatron_parallel_flags(config, global_batch, blocks)
    if config.tp > 1:
        flags.append("--sequence-parallel --tp-comm-overlap")
    if config.cp > 1:  # ep carved from dp × cp there too (`parallel_state`); the type priced
        flags.append(f"--context-parallel-size {config.cp} "
                     f"--cp-comm-type {target.cp_comm_type}")
    if target.experts:  # expert tensor parallelism as priced (1 unless asked; its default is tp's)
        # DeepEP takes fp32 routing probabilities only (token_dispatcher.py's _DeepepManager)
        dispatch = ("flex --moe-flex-dispatcher-backend deepep --moe-router-dtype fp32"
                    if target.moe_dispatcher == "deepep" else "alltoall")
        flags.append(f"--expert-model-parallel-size {config.ep} --expert-tensor-parallel-size "
                     f"{_expert_tp(config, target)} --moe-token-dispatcher-type {dispatch}")
        groups, top_groups = target.expert_groups
        if groups > 1:
            flags.append(f"--moe-router-num-groups {groups} "
                         f"--moe-router-group-topk {top_groups}")
    flags.append("--overlap-grad-reduce")
    if config.zero_stage:
        flags.append("--use-distributed-optimizer --overlap-param-gather")
    flags += _recompute_flags(config)
    return [_torchrun(target, "pretrain_gpt.py") + " " + " ".join(flags)
            + "   # plus the model's flags (--num-layers, --hidden-size, ...) and --bf16"]


def _megatron_2021(config: PlanConfig, global_batch: int, blocks: int) -> list[str]:
    """Megatron-LM 2021's `pretrain_gpt.py` arguments (the flags of its SC'21 scripts,
    `examples/sc21/CONFIG.sh` and `run_table_1.sh`)."""
    flags = _megatron_parallel_flags(config, global_batch, blocks)
    if config.recompute == "full":
        flags.append("--checkpoint-activations")
    flags.append(f"--DDP-impl {'torch' if config.pp == 1 else 'local'}")
    return ["Megatron-LM (2021) pretrain_gpt.py " + " ".join(flags)]


def _deepspeed(config: PlanConfig, global_batch: int, target: LaunchTarget,
               boundaries: tuple[int, ...]) -> list[str]:
    ds_config = {"train_batch_size": global_batch,
                 "train_micro_batch_size_per_gpu": config.microbatch_size,
                 "gradient_accumulation_steps": config.num_microbatches,
                 "zero_optimization": {"stage": config.zero_stage}, "bf16": {"enabled": True}}
    module = (f"PipelineModule(layers, num_stages={config.pp}, "
              f"topology=PipeModelDataParallelTopology(num_pp={config.pp}, "
              f"num_mp={config.tp}, num_dp={config.dp}), partition_method=<cuts "
              f"{list(boundaries)} of the planner's layers>, "
              f"activation_checkpoint_interval={1 if config.recompute == 'full' else 0})")
    return [f"deepspeed --num_nodes {target.nodes} --num_gpus {target.devices_per_node} "
            f"train.py --deepspeed_config ds_config.json",
            f"ds_config.json: {json.dumps(ds_config)}",
            f"train.py: {module}; deepspeed.initialize(model=..., config='ds_config.json'); "
            "engine.train_batch() per step"]


def launch_lines(name: str, config: PlanConfig, global_batch: int, blocks: int, *,
                 target: LaunchTarget | None = None,
                 boundaries: tuple[int, ...] = ()) -> list[str]:
    """How to run `config` on engine `name` (`blocks` transformer layers; `boundaries` the
    planner's stage cuts): this engine's launcher line and Python entry (for a HF model, the
    script that trains it, tp included), or the other engines' command lines."""
    target = target or LaunchTarget(engine=name, blocks=blocks)
    if name == "megatron-2021":
        return _megatron_2021(config, global_batch, blocks)
    if name == "megatron-core":
        return _megatron_core(config, global_batch, target, blocks)
    if name == "deepspeed":
        return _deepspeed(config, global_batch, target, boundaries)
    return _pipesched(config, global_batch, target, blocks, boundaries)


def hf_source(path: str, model_type: str) -> HFSource:
    """The HF source of a `--model` path (a directory or its config.json)."""
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    return HFSource(directory, 2 if model_type == "gpt2" else 1)
