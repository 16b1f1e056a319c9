"""`pipesched run`: train a HF model directory on a token file, under torchrun or on local
ranks, with checkpoints that resume and per-step throughput."""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path
from typing import Any

from pipeline.cli.options import (
    non_negative_float,
    positive_float,
    positive_int,
    seed_int,
    timeout_seconds,
)
from pipeline.files import InputFileType, OutputFileType
from pipeline.limits import MAX_INPUT_BYTES
from schedules import SCHEDULES

__all__ = ["register", "run"]

_DESCRIPTION = """\
Train the HF causal LM in MODEL (a directory save_pretrained wrote: config.json and its
safetensors) on DATA, a flat token file, as a pipeline of --stages × --data-parallel ×
--tp ranks. Under torchrun (one process per rank; RANK, WORLD_SIZE, MASTER_ADDR set) each
process runs its own rank; without torchrun the ranks run as local processes.

The sizes come from the flags, or from --plan (the JSON `pipesched plan --json` writes;
flags given override it). `pipesched plan --model DIR --cluster ...` prints the torchrun
line that runs this command on its pick.

DATA holds token ids back to back (uint16 or uint32, as nanoGPT's train.bin or Megatron's
.bin), mapped into memory, read lazily; its dtype comes from --data-dtype or DATA.json
({"dtype": "uint16"}). It is cut into windows of --seq-len + 1 tokens (inputs the first
--seq-len, targets the last), --batch-size of them a step, split over the data-parallel
replicas; --shuffle-seed draws each epoch's order. With --checkpoint DIR a checkpoint
(weights, optimizer, generators and the data position) goes to DIR every --save-every
steps and after the last; the same command resumes from DIR's latest, seeing exactly the
batches an uninterrupted run would. Rank 0 logs each step's loss, tokens/s, model TFLOP/s
per device, MFU (PaLM's 6N + 12LHQT FLOPs per token over the device peak) and peak memory.
"""

_PLAN_KEYS = ("stages", "chunks", "data_parallel", "tp", "schedule", "microbatches",
              "batch_size", "seq_len", "partition", "zero", "recompute", "recompute_layers",
              "sequence_parallel", "tp_comm_overlap")
_DEFAULTS: dict[str, Any] = {"stages": 1, "chunks": 1, "data_parallel": 1, "tp": 1,
                             "schedule": "1f1b", "microbatches": 1, "partition": "parameters",
                             "zero": 0, "recompute": "none", "recompute_layers": None,
                             "sequence_parallel": False, "tp_comm_overlap": False}


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "run", help="train a HF model directory on a token file (torchrun or local ranks)",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR",
                        type=InputFileType(MAX_INPUT_BYTES, json_document=True,
                                           directory_file="config.json"),
                        help="HF model directory (config.json + safetensors)")
    parser.add_argument("--data", required=True, metavar="FILE", help="flat token file")
    parser.add_argument("--data-dtype", choices=("uint16", "uint32", "int32"), default=None,
                        help="token dtype (default: FILE.json's \"dtype\")")
    parser.add_argument("--plan", default=None, metavar="PLAN.json",
                        type=InputFileType(MAX_INPUT_BYTES, json_document=True),
                        help="sizes from `pipesched plan --json` output (flags override)")
    parser.add_argument("--steps", type=positive_int, required=True, metavar="N",
                        help="train until step N (a resumed run counts the steps it resumed)")
    parser.add_argument("--stages", type=positive_int, default=None, metavar="P",
                        help="pipeline stages (ranks per pipeline; default 1)")
    parser.add_argument("--chunks", type=positive_int, default=None, metavar="V",
                        help="model chunks per rank (interleaved schedules; default 1)")
    parser.add_argument("--data-parallel", type=positive_int, default=None, metavar="D",
                        help="pipeline replicas (default 1)")
    parser.add_argument("--tp", type=positive_int, default=None, metavar="T",
                        help="tensor-parallel size (tensor_parallel_hf; default 1)")
    parser.add_argument("--schedule", default=None, choices=sorted(SCHEDULES),
                        metavar="SCHEDULE", help="pipeline schedule (default 1f1b)")
    parser.add_argument("--microbatches", type=positive_int, default=None, metavar="M",
                        help="microbatches per step and replica (default 1)")
    parser.add_argument("--batch-size", type=positive_int, default=None, metavar="B",
                        help="global batch in sequences, all replicas together")
    parser.add_argument("--seq-len", type=positive_int, default=None, metavar="S",
                        help="tokens per sequence")
    parser.add_argument("--partition", default=None, metavar="CUTS",
                        help="stage cuts into layers_from_hf's layers, e.g. 0,3,6 (plan "
                             "prints them), or a method: parameters (default), uniform")
    parser.add_argument("--zero-stage", "--zero", dest="zero", type=int,
                        choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage (default 0)")
    parser.add_argument("--recompute", choices=("none", "selective", "full", "partial"),
                        default=None, help="activation recomputation (default none)")
    parser.add_argument("--recompute-layers", type=positive_int, default=None, metavar="K",
                        help="partial recomputation: the first K layers of each stage")
    parser.add_argument("--sequence-parallel", action="store_true", default=None,
                        help="tp > 1: sequence parallelism")
    parser.add_argument("--tp-comm-overlap", action="store_true", default=None,
                        help="tp > 1: overlap the tp collectives with the GEMMs")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="compute precision (default fp32)")
    parser.add_argument("--lr", type=non_negative_float, default=3e-4,
                        help="AdamW learning rate (default 3e-4, constant)")
    parser.add_argument("--shuffle-seed", type=seed_int, default=None, metavar="SEED",
                        help="draw each epoch's sequence order from SEED (default: file order)")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="save to DIR and resume from its latest checkpoint")
    parser.add_argument("--save-every", type=positive_int, default=100, metavar="N",
                        help="steps between checkpoints (default 100; also after the last)")
    parser.add_argument("--metrics", default=None, metavar="FILE", type=OutputFileType(),
                        help="append one JSON line per step (loss, tokens/s, TFLOP/s, MFU, "
                             "memory, data position)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR",
                        help="TensorBoard scalars in DIR (needs the tensorboard package)")
    parser.add_argument("--peak-tflops", type=positive_float, default=None, metavar="X",
                        help="device peak for MFU (default: the datasheet figure of a known "
                             "GPU; on a CPU the measured fp32 matmul rate of a rank)")
    parser.add_argument("--timeout", type=timeout_seconds, default=300.0, metavar="SECONDS",
                        help="how long any wait between ranks may take (default 300)")
    parser.set_defaults(func=run)


def _from_plan(path: str) -> dict[str, Any]:
    """`pipesched run`'s options from a plan JSON: its ``run_arguments`` (a HF model's pick),
    else the pick's sizes."""
    from pipeline.planner.input_files import read_input_json

    document = read_input_json(path, "--plan")
    pick = document.get("pick") if isinstance(document, dict) else None
    if not isinstance(pick, dict) or not isinstance(pick.get("config"), dict):
        raise ValueError(f"--plan {path}: no pick.config in it; pass the JSON `pipesched plan "
                         "--json` prints")
    if document.get("engine", "pipesched") != "pipesched":
        raise ValueError(f"--plan {path} prices --engine {document['engine']}; plan again "
                         "with --engine pipesched")
    if isinstance(pick.get("run_arguments"), dict):
        return dict(pick["run_arguments"])
    config = pick["config"]
    return {"stages": config["pp"], "chunks": config["chunks"], "data_parallel": config["dp"],
            "tp": config["tp"], "schedule": config["schedule"],
            "microbatches": config["num_microbatches"],
            "batch_size": document["global_batch"], "zero": config["zero_stage"],
            "recompute": config["recompute"],
            "recompute_layers": config.get("recompute_layers") or None}


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Flags given, else the plan's values, else the defaults."""
    planned = _from_plan(args.plan) if args.plan is not None else {}
    unknown = sorted(set(planned) - set(_PLAN_KEYS))
    if unknown:
        raise ValueError(f"--plan {args.plan}: unknown run arguments {unknown}")
    options = {}
    for key in _PLAN_KEYS:
        given = getattr(args, key)
        options[key] = given if given is not None else planned.get(key, _DEFAULTS.get(key))
    for key in ("batch_size", "seq_len"):
        if options[key] is None:
            raise ValueError(f"--{key.replace('_', '-')} is needed (or a --plan that has it)")
    return options


def _partition(text: str, layers: int, slots: int) -> tuple[int, ...] | str:
    if not any(ch.isdigit() for ch in text):
        if text not in ("parameters", "uniform"):
            raise ValueError(f"--partition {text!r}: give cuts such as 0,3,6 or a method "
                             "(parameters, uniform)")
        return text
    try:
        cuts = tuple(int(item) for item in text.split(","))
    except ValueError:
        raise ValueError(f"--partition {text!r}: cuts must be whole numbers, e.g. 0,3,6") \
            from None
    if len(cuts) != slots + 1 or cuts[0] != 0 or cuts[-1] != layers or \
            any(a >= b for a, b in itertools.pairwise(cuts)):
        raise ValueError(f"--partition {text!r}: need {slots + 1} rising cuts from 0 to "
                         f"{layers} (the model's layers) for {slots} stage slots")
    return cuts


def _config(args: argparse.Namespace) -> tuple[Any, int]:
    """The checked `RunConfig` and the world size, before any rank starts."""
    model = Path(args.model)
    if not (model / "config.json").is_file():  # before transformers and torch import
        raise ValueError(f"--model {model}: no config.json there; pass a directory "
                         "save_pretrained wrote")
    import transformers

    from pipeline.interop.hf_layers import MOE, layers_from_hf
    from pipeline.jobs.hf_run import RunConfig
    from pipeline.jobs.token_data import TokenBatches, open_token_file
    from schedules import generate_schedule

    options = _options(args)
    hf_config = transformers.AutoConfig.from_pretrained(str(model))
    if hf_config.model_type in MOE:
        raise ValueError(f"--model {model}: pipesched run trains dense models; a mixture of "
                         "experts trains through pipesched train --model RECIPE")
    hf = layers_from_hf(hf_config)
    stages, tp, dp = options["stages"], options["tp"], options["data_parallel"]
    schedule = generate_schedule(options["schedule"], stages, options["microbatches"],
                                 options["chunks"])
    if not schedule.has_backward:
        raise ValueError(f"--schedule {options['schedule']} runs forwards only; pick one "
                         "with a backward, e.g. 1f1b")
    if options["batch_size"] % (dp * options["microbatches"]):
        raise ValueError(f"--batch-size {options['batch_size']} must split into "
                         f"--data-parallel {dp} × --microbatches {options['microbatches']} "
                         "equal microbatches")
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and options["seq_len"] > limit:
        raise ValueError(f"--seq-len {options['seq_len']} exceeds the model's "
                         f"max_position_embeddings {limit}")
    if tp > 1:
        from pipeline.interop.hf_tensor_parallel import check_tensor_parallel_size

        check_tensor_parallel_size(hf_config, tp)
    if args.tensorboard is not None:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ValueError("--tensorboard needs the tensorboard package: pip install "
                             "tensorboard, or drop --tensorboard (--metrics writes JSONL)") \
                from None
    TokenBatches(open_token_file(args.data, args.data_dtype), seq_len=options["seq_len"],
                 global_batch=options["batch_size"], data_parallel=dp, replica=0,
                 vocab_size=hf_config.vocab_size)  # sizes refused here, not on every rank
    config = RunConfig(
        model=str(model), data=str(args.data), data_dtype=args.data_dtype, stages=stages,
        chunks=schedule.chunks, data_parallel=dp, tensor_parallel=tp,
        schedule=options["schedule"], microbatches=options["microbatches"],
        batch_size=options["batch_size"], seq_len=options["seq_len"], steps=args.steps,
        lr=args.lr, partition=_partition(str(options["partition"]), len(hf.layers),
                                         stages * schedule.chunks),
        zero_stage=options["zero"], recompute=options["recompute"],
        recompute_layers=options["recompute_layers"],
        sequence_parallel=bool(options["sequence_parallel"]),
        tp_overlap=bool(options["tp_comm_overlap"]), precision=args.precision,
        shuffle_seed=args.shuffle_seed, checkpoint=args.checkpoint,
        save_every=args.save_every,
        metrics=None if args.metrics is None else str(args.metrics), tensorboard=args.tensorboard,
        peak_tflops=args.peak_tflops, timeout=args.timeout)
    return config, stages * dp * tp


def run(args: argparse.Namespace) -> int:
    config, world = _config(args)  # its first check comes before torch imports
    from pipeline.jobs.hf_run import RunReport, run_rank
    from pipeline.launcher.processes import launch
    from pipeline.limits import check_local_ranks

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun and int(os.environ["WORLD_SIZE"]) != world:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} processes but "
                         f"--stages × --data-parallel × --tp is {world}; pass "
                         f"--nproc-per-node (× --nnodes) = {world}")
    if not under_torchrun:
        check_local_ranks(world, "--stages × --data-parallel × --tp")
    report: RunReport | None = launch(run_rank, world, config, timeout=config.timeout,
                                      quiet=True)[0]
    if report is not None and report.losses:
        first, last = min(report.losses), max(report.losses)
        print(json.dumps({"steps": [first, last], "resumed_from": report.resumed_from,
                          "final_loss": report.losses[last]}))
    return 0
