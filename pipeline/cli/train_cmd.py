"""`pipesched train`: the demo — partition a small language model, train it on local CPU ranks
with a schedule, and write the measured timeline, a Perfetto trace and a summary."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from pipeline.cli.options import (
    add_schedule_arguments,
    non_negative_float,
    positive_int,
    seed_int,
    timeout_seconds,
)
from pipeline.cli.train_checks import (
    check_experts,
    check_model_file,
    check_train_args,
    demo_heads,
)
from pipeline.files import InputFileType
from pipeline.limits import MAX_SOURCE_BYTES
from schedules import Figures, figures, generate_schedule, simulate

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "train", help="train a small transformer LM on local CPU ranks (the demo)",
        description="Profile and partition a small decoder-only language model over P stages, "
                    "train it on synthetic sequences with a pipeline schedule on local CPU "
                    "processes (gloo), and write the measured timeline plot, a Perfetto trace, "
                    "the loss curve and a summary of measured vs simulated bubble.")
    add_schedule_arguments(parser, defaults=("1f1b", 4, 8), memory_limit=False)
    parser.add_argument("--data-parallel", type=positive_int, default=1, metavar="D",
                        help="pipeline replicas; P × D processes in all (default 1)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="T",
                        help="tensor-parallel size: each stage's layers split over T ranks "
                             "(P × D × T local ranks); needs a --model whose recipe splits "
                             "(e.g. tensor_parallel_hf layers) and says which T it can take")
    parser.add_argument("--cp", type=positive_int, default=1, metavar="C",
                        help="context-parallel size: each sequence split over C ranks "
                             "(P × D × C × T local ranks); needs a --model whose recipe "
                             "splits sequences (e.g. context_parallel_hf layers)")
    parser.add_argument("--expert-parallel", type=positive_int, default=1, metavar="E",
                        help="expert-parallel size: each MoE layer's experts split over E of "
                             "the --data-parallel × --cp replicas (E divides D·C and the "
                             "experts); "
                             "needs a --model with MoE layers (default 1)")
    parser.add_argument("--expert-tensor-parallel", type=positive_int, default=1, metavar="ET",
                        help="1 (default): each expert whole on its expert-parallel rank; "
                             "--tp's value: each expert's weights split over the tp group too "
                             "(Megatron-Core's --expert-tensor-parallel-size)")
    parser.add_argument("--two-batch-overlap", action="store_true",
                        help="run each forward of an MoE stage as two halves of its "
                             "microbatch taking turns at their expert all-to-alls (hides "
                             "them outside dualpipev-overlap's F&B pairs too); needs "
                             "--expert-parallel > 1")
    parser.add_argument("--zero-stage", "--zero", type=int, choices=(0, 1, 2, 3), default=0,
                        metavar="Z",
                        help="ZeRO over the --data-parallel replicas: 1 shards optimizer "
                             "states, 2 also gradients (reduce-scattered every backward), 3 "
                             "also parameters (each layer gathered for its forward and "
                             "backward); default 0")
    parser.add_argument("--no-reshard-after-forward", dest="reshard_after_forward",
                        action="store_false",
                        help="--zero-stage 3: keep each layer gathered from its first forward "
                             "until the step (fewer gathers, more memory)")
    parser.add_argument("--steps", type=positive_int, default=30, metavar="N",
                        help="training steps (default 30)")
    parser.add_argument("--batch-size", type=positive_int, default=32, metavar="B",
                        help="global batch size in sequences (default 32)")
    parser.add_argument("--blocks", type=positive_int, default=8,
                        help="decoder blocks (default 8; layers = blocks + 2)")
    parser.add_argument("--width", type=positive_int, default=64, help="hidden size (default 64)")
    parser.add_argument("--seq-len", type=positive_int, default=32, help="tokens per sequence")
    parser.add_argument("--lr", type=non_negative_float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--partition", default="balanced", metavar="METHOD",
                        help="balanced (profiled costs, default), uniform, parameters or "
                             "type:<regex>")
    parser.add_argument("--model", metavar="MODULE:FUNCTION", default=None,
                        type=InputFileType(MAX_SOURCE_BYTES, or_text=True, suffix_separator=":"),
                        help="train your own layer list instead of the demo LM: FUNCTION() "
                             "returns pipeline.demo.user_model.ModelRecipe(layers, loss_fn, "
                             "batch); MODULE is a module name or a .py path (--blocks, "
                             "--width, --seq-len are then unused)")
    parser.add_argument("--seed", type=seed_int, default=0, help="model and data seed")
    parser.add_argument("--timeout", type=timeout_seconds, default=120.0, metavar="SECONDS",
                        help="how long any wait between ranks may take before the run fails "
                             "naming the rank that stopped progressing (default 120)")
    parser.add_argument("--out", type=Path, default=Path("pipesched-out"), metavar="DIR",
                        help="directory for timeline.png, trace.json, loss.png, summary.json")
    parser.set_defaults(func=run)


def _partition(args: argparse.Namespace, config: Any, num_stages: int
               ) -> tuple[Any, tuple[float, ...]]:
    """Profile every layer on one microbatch in this process and partition by measured cost;
    also each stage's activation bytes per microbatch (its layers' measured saved tensors)."""
    import torch

    from partition import graph_from_layers, parse_method, partition_graph
    from pipeline.demo.language_model import lm_layers, synthetic_batch

    method, pattern = parse_method(args.partition)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # profile as the ranks will run: one thread each
    microbatch = args.batch_size // args.data_parallel // args.microbatches
    if args.model is not None:  # the user's layers, built as the ranks will build them
        from pipeline.model.layers import build_layer

        layers = [build_layer(layer, k, base_seed=args.seed)
                  for k, layer in enumerate(args.recipe.layers)]
        # still before any rank starts
        check_experts(layers, args.expert_parallel, args.expert_tensor_parallel)
        sample, _ = args.recipe.batch(0, microbatch)
    else:
        layers = [spec.build() for spec in lm_layers(config)]
        sample, _ = synthetic_batch(0, microbatch, config, seed=args.seed)
    graph = graph_from_layers(layers, sample, repeats=5)
    part = partition_graph(graph, num_stages, method=method, type_pattern=pattern)
    activation = graph.array("activation")
    held = tuple(float(activation[start:stop].sum())
                 for start, stop in zip(part.boundaries, part.boundaries[1:]))
    return part, held


def _summary_line(label: str, result: Figures) -> str:
    return (f"{label:<38} makespan {1000 * result.makespan:8.1f} ms   bubble rate "
            f"{100 * result.bubble_rate:5.1f}%   idle {100 * result.idle_fraction:5.1f}%")


def run(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    chunks = check_train_args(args)  # before the imports below: a refusal does not wait for torch
    from pipeline.cli import report_run_failure
    from pipeline.demo.language_model import TinyLMConfig
    from pipeline.demo.train_job import TrainConfig, TrainReport, train_rank
    from pipeline.errors import RankFailedError
    from pipeline.launcher.processes import launch
    from pipeline.limits import check_run_seconds
    from pipeline.runtime.trace import measured_costs
    from viz import plot_timeline, plot_training, write_trace

    model = TinyLMConfig(width=args.width, blocks=args.blocks, seq_len=args.seq_len,
                         heads=demo_heads(args.width))
    # 1. Partition on measured per-layer costs (one process, before any rank starts).
    part, stage_activation_bytes = _partition(args, model, args.stages * chunks)
    # Every step runs each stage's work for every microbatch: the slowest stage bounds it.
    check_run_seconds(args.steps * args.microbatches * max(part.compute),
                      f"--steps {args.steps:,}")
    print(part.format_table(), end="\n\n")
    # 2. Train on P × D local processes.
    config = TrainConfig(stages=args.stages, schedule=args.schedule,
                         microbatches=args.microbatches, chunks=chunks,
                         data_parallel=args.data_parallel, tensor_parallel=args.tp,
                         context_parallel=args.cp,
                         expert_parallel=args.expert_parallel,
                         expert_tensor_parallel=args.expert_tensor_parallel,
                         two_batch_overlap=args.two_batch_overlap,
                         zero_stage=args.zero_stage,
                         reshard_after_forward=args.reshard_after_forward, steps=args.steps,
                         batch_size=args.batch_size, lr=args.lr, seed=args.seed, model=model,
                         user_model=args.model,
                         boundaries=tuple(part.boundaries), timeout=args.timeout)
    world = args.stages * args.data_parallel * args.cp * args.tp
    print(f"training {args.schedule} on {world} CPU ranks (p={args.stages}, "
          f"dp={args.data_parallel}, {f'cp={args.cp}, ' if args.cp > 1 else ''}tp={args.tp}, "
          f"ep={args.expert_parallel}, "
          f"{f'etp={args.expert_tensor_parallel}, ' if args.expert_tensor_parallel > 1 else ''}"
          f"v={chunks}, "
          f"{f'ZeRO-{args.zero_stage}, ' if args.zero_stage else ''}"
          f"m={args.microbatches}), "
          f"{args.steps} steps")
    if args.two_batch_overlap:  # issue 46: it ran 5.6x slower here with no word
        print("note: --two-batch-overlap hides an expert all-to-all behind the other half's "
              "compute; between local CPU ranks gloo's all-to-all costs microseconds, so the "
              "halves add thread hand-overs and hide nothing: expect each step slower than "
              "without it (it pays where the all-to-all crosses devices: "
              "docs/huggingface-and-deepspeed.md)", file=sys.stderr)
    try:
        report: TrainReport | None = launch(train_rank, world, config,
                                            timeout=args.timeout, quiet=True)[0]
    except RankFailedError as error:
        return report_run_failure("train", error, args.out)
    if report is None:
        raise RuntimeError("rank 0 returned no report")
    # 3. Measured last step against the simulator fed with the measured op costs.
    # The measured timeline has each op's times; its activation bytes per stage and
    # microbatch are the profiled layers' (so peak_activation_bytes is measured, not 0).
    timeline = dataclasses.replace(report.timeline, activation_bytes=stage_activation_bytes)
    measured = figures(timeline)
    schedule = generate_schedule(args.schedule, args.stages, args.microbatches, chunks)
    simulated = figures(dataclasses.replace(simulate(schedule, measured_costs(
        report.timeline).cost_model(schedule.num_stages)),
        activation_bytes=stage_activation_bytes))
    out: Path = args.out
    plot_timeline(report.timeline, out / "timeline.png")
    write_trace(report.timeline, out / "trace.json")
    plot_training(report.losses, report.step_seconds, out / "loss.png",
                  title=f"{args.schedule}  p={args.stages}  m={args.microbatches}")
    median_step = statistics.median(report.step_seconds[1:] or report.step_seconds)
    summary = {
        "schedule": args.schedule, "stages": args.stages, "chunks": chunks,
        "data_parallel": args.data_parallel, "microbatches": args.microbatches,
        "boundaries": list(part.boundaries), "losses": report.losses,
        "step_seconds": report.step_seconds, "median_step_seconds": median_step,
        "measured": measured.to_dict(), "simulated_from_measured_costs": simulated.to_dict(),
        "peak_activations_measured": report.peak_activations,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nloss {report.losses[0]:.3f} -> {report.losses[-1]:.3f};  median step "
          f"{1000 * median_step:.0f} ms")
    print(_summary_line("last step, measured:", measured))
    print(_summary_line("simulated from measured op costs:", simulated))
    print(f"peak activations per rank: measured {report.peak_activations}, simulated "
          f"{list(simulated.peak_activations)}")
    for name in ("timeline.png", "trace.json", "loss.png", "summary.json"):
        print(f"pipesched train: wrote {out / name}", file=sys.stderr)
    return 0
