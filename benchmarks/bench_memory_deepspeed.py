"""Peak tensor memory per rank, ours against DeepSpeed's pipeline engine: same model, 1F1B, same
microbatches, ZeRO-1, in bf16 and in fp32 (issue 20's goal: ours ≤ 0.8 × DeepSpeed's).

Both engines train bench_3d's model (16 × (Linear(512), GELU), Adam lr 1e-4, loss
``mse_loss(output.float(), target)``) on pp 2 × dp 2 = 4 CPU ranks (gloo, 1 thread each),
``uniform`` partition, 1F1B (DeepSpeed's only schedule) with m microbatches, ZeRO-1. bf16:
ours with the precision='bf16' path of this checkout (``half_parameters=True`` where the
engine has it: bf16 parameters, fp32 main gradients and master shard; otherwise autocast over
fp32 parameters); DeepSpeed with ``bf16.enabled`` and fp32 gradient accumulation
(``data_types.grad_accum_dtype='fp32'``: its `BF16_Optimizer`, the same numerics), and, as a
third row, DeepSpeed's default bf16 gradient accumulation (its ZeRO-1 optimizer on bf16
gradients). DeepSpeed's ZeRO-1 optimizer (fp32, and bf16 accumulation) allocates two
reduction buckets of ``reduce_bucket_size`` elements per step whatever the model: they are
set to the stage's parameter count here (its default, 5e8, adds GiBs:
``--deepspeed-default-buckets``). Each engine runs in its own launch (so nothing of one is
alive beside the other).

How peak memory is measured, identically for both engines (`LiveTensorMeter`,
pipeline/runtime/live_memory.py): a `TorchDispatchMode` entered on every rank before the
engine, its model and its optimizer are built sees every tensor a torch op returns; each new
storage is counted once (views share it) with its full size until a weak reference to it
reports it freed. Saved-tensor hooks mark the storages autograd holds for backward. After a
warm-up step (Adam's state is made in the first step) and a `gc.collect()` (tensors only
reference cycles hold would otherwise count, as many as the collector's timing leaves),
``begin_step`` makes everything alive then "states" and the peak of the next step is
recorded with its split:

- states: alive between steps — parameters, gradients kept between steps, optimizer state,
  masters, and what an engine keeps between steps (DeepSpeed: its last step's losses and
  the labels in its pipe buffers, until its next step starts);
- activations: made in the step and held by autograd for a backward at the peak;
- other: made in the step, not saved for backward — gradients made in the step, stage inputs
  and outputs the engine holds, communication buffers, temporaries, the step's data.

The data, two ways (``--feed``), the same for both engines: "iterator" (the default, what a
DataLoader does): each engine is given an iterator that makes each microbatch (inputs,
targets) when it is pulled — DeepSpeed's ``train_batch(data_iter)`` pulls one per
``LoadMicroBatch``, ours one per LOAD (`PulledMicrobatches`), so only microbatches in flight
are alive; the inputs are in the dtype DeepSpeed's first stage takes (bf16 under bf16; ours
would cast fp32 inputs itself, the same microbatches are given to both). "full batch": the
rank's whole batch is made first, in fp32, and alive through the step (ours gets it as
``train_batch(x, y)``, DeepSpeed an iterator of bf16 copies of its microbatches).

This is what a non-caching allocator would hold for tensors (on CPU there is no
`torch.cuda.max_memory_allocated`); Python objects, gloo's own buffers and datagrams our
one-host link queued before their receive was posted are not tensors and are not counted.
Our counted bytes are deterministic: one measured step is enough (DeepSpeed's moved by up to
0.5 MiB between runs here).

    /work/venvs/dsmem/bin/python benchmarks/bench_memory_deepspeed.py          # m = 8, both feeds
    /work/venvs/dsmem/bin/python benchmarks/bench_memory_deepspeed.py --batch 16384 --labels
    python benchmarks/bench_memory_deepspeed.py       # no DeepSpeed: says so, measures nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_3d import DEPTH, DP, PP, WIDTH, _adam, _layers

from pipeline import LayerSpec, PipelineEngine, PipelineModule, launch
from pipeline.parallel.config import ParallelConfig
from pipeline.parallel.data_parallel import DEFAULT_BUCKET_MB
from pipeline.runtime.live_memory import LiveSplit, LiveTensorMeter

__all__ = ["ENGINES", "FEEDS", "GOAL", "RankPeak", "format_table", "main", "measure_peaks",
           "memory_rows"]

GOAL = 0.8
"""Issue 20: our peak per rank at most this fraction of DeepSpeed's (bf16, ZeRO-1)."""
ENGINES = ("ours", "deepspeed", "deepspeed-bf16-accumulation")
"""What `measure_peaks` can run: ours; DeepSpeed with fp32 gradient accumulation (bf16 only,
as ours); DeepSpeed's default for bf16 (gradients accumulated in bf16)."""
FEEDS = ("iterator", "full batch")
"""How the step's data reaches both engines (module docstring)."""
Data = Iterator[tuple[torch.Tensor, torch.Tensor]] | tuple[torch.Tensor, torch.Tensor]
"""An iterator making each microbatch when pulled, or the rank's whole (inputs, targets)."""
Step = Callable[[Data], None]


@dataclasses.dataclass(frozen=True)
class RankPeak:
    """One rank's peak in the measured step."""

    rank: int
    peak: LiveSplit
    """Live tensor bytes at the step's peak, by what holds them."""
    parameters: int
    """Elements of the parameters this rank's stages own."""
    labels: dict[str, int]
    """At the peak: bytes per "kind dtype op-that-made-it" (only with ``labels=True``)."""


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


def _ours(precision: str, m: int) -> tuple[Step, int]:
    module = PipelineModule(_layers(LayerSpec), num_stages=PP, loss_fn=_loss,
                            partition_method="uniform")
    half = {"half_parameters": True} if precision != "fp32" and "half_parameters" in {
        field.name for field in dataclasses.fields(ParallelConfig)} else {}
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=m, optimizer=_adam,
                            data_parallel=DP, zero_stage=1, precision=precision, **half)

    def step(data: Data) -> None:
        if isinstance(data, tuple):
            engine.train_batch(*data)
        else:
            engine.train_batch(data_iter=data)
    return step, sum(p.numel() for p in module.parameters())


def _deepspeed(precision: str, m: int, batch: int, accumulate_in_fp32: bool,
               default_buckets: bool) -> tuple[Step, int]:
    import deepspeed
    from deepspeed.pipe import LayerSpec as DSLayerSpec
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    module = DSPipelineModule(layers=_layers(DSLayerSpec), num_stages=PP, loss_fn=_loss,
                              partition_method="uniform")
    config: dict[str, Any] = {
        "train_batch_size": batch, "train_micro_batch_size_per_gpu": batch // (DP * m),
        "gradient_accumulation_steps": m, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    if not default_buckets:
        # In a pipeline its ZeRO-1 optimizer allocates two reduction buckets of this many
        # elements per step, whatever the stage holds; ours are at most DEFAULT_BUCKET_MB of
        # the stage's gradients. Smallest bucket that still reduces the stage in one piece,
        # the choice kindest to DeepSpeed (its default: 5e8 elements).
        elements = min(int(DEFAULT_BUCKET_MB * 2**20) // 4,
                       sum(p.numel() for p in module.parameters()))
        config["zero_optimization"].update(reduce_bucket_size=elements,
                                           allgather_bucket_size=elements)
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        if accumulate_in_fp32:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    engine, _, _, _ = deepspeed.initialize(model=module,
                                           optimizer=_adam(list(module.parameters())),
                                           config=config)
    size = batch // (DP * m)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32  # its stages' dtype

    def step(data: Data) -> None:
        if isinstance(data, tuple):
            # copies of the full batch's microbatches, each its own tensors (its label
            # buffers keep the last ones until the next step: views would pin all of y)
            x, y = data
            pairs: Iterator[tuple[torch.Tensor, torch.Tensor]] = (
                (x[k * size:(k + 1) * size].to(dtype, copy=True),
                 y[k * size:(k + 1) * size].clone()) for k in range(m))
        else:
            pairs = data
        engine.train_batch(data_iter=pairs)
        next(pairs, None)  # it keeps the iterator: let a generator drop what it holds
    return step, sum(p.numel() for p in module.parameters())


def _rank_peak(engine_name: str, precision: str, m: int, batch: int, labels: bool,
               default_buckets: bool, feed: str) -> RankPeak:
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(dist.get_rank() % DP)  # one half per replica
    # the same microbatches for both: in the dtype DeepSpeed's first stage takes (ours would
    # also cast fp32 inputs itself)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    size = batch // (DP * m)

    def microbatches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(m):
            yield (torch.randn(size, WIDTH, generator=generator).to(dtype),
                   torch.randn(size, WIDTH, generator=generator))

    def run(step: Step) -> None:
        if feed == "full batch":
            step((torch.randn(batch // DP, WIDTH, generator=generator),
                  torch.randn(batch // DP, WIDTH, generator=generator)))
            return
        step(microbatches())

    meter = LiveTensorMeter(labels=labels)
    with meter:
        if engine_name == "ours":
            step, parameters = _ours(precision, m)
        else:
            step, parameters = _deepspeed(precision, m, batch, engine_name == "deepspeed",
                                          default_buckets)
        torch.set_num_threads(1)  # in case a framework changed it
        run(step)  # warm-up: Adam's state and the engines' lazy buffers appear here
        dist.barrier()
        gc.collect()  # what only reference cycles still hold is not state
        meter.begin_step()
        run(step)
        dist.barrier()
    return RankPeak(dist.get_rank(), meter.peak, parameters, dict(meter.peak_labels))


def measure_peaks(engine_name: str, precision: str, *, m: int = 8, batch: int = 4096,
                  labels: bool = False, default_buckets: bool = False,
                  feed: str = "iterator") -> list[RankPeak]:
    """Peak live tensor bytes of every rank (index = rank) in one measured step of
    `engine_name` (one of `ENGINES`) at `precision` ('fp32' or 'bf16'), pp 2 × dp 2, ZeRO-1,
    1F1B with `m` microbatches of ``batch // (2 · m)`` rows each, the data fed as `feed`
    (one of `FEEDS`, module docstring); DeepSpeed must be
    importable for the DeepSpeed engines. DeepSpeed's ZeRO buckets hold the stage's
    parameters (at most our `DEFAULT_BUCKET_MB` of fp32 elements) unless `default_buckets`
    (5e8 elements): in a pipeline its ZeRO-1 optimizer allocates two reduction buckets of
    that many elements in every step."""
    if engine_name not in ENGINES:
        raise ValueError(f"engine_name must be one of {ENGINES}, got {engine_name!r}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    if batch % (DP * m):
        raise ValueError(f"batch {batch} must be a multiple of dp · m = {DP * m}")
    if feed not in FEEDS:
        raise ValueError(f"feed must be one of {FEEDS}, got {feed!r}")
    return launch(_rank_peak, PP * DP, engine_name, precision, m, batch, labels,
                  default_buckets, feed, timeout=600, threads_per_rank=1)


def memory_rows(precisions: tuple[str, ...] = ("bf16", "fp32"), *, m: int = 8,
                batch: int = 4096, labels: bool = False, default_buckets: bool = False,
                feeds: tuple[str, ...] = FEEDS) -> list[dict[str, Any]]:
    """One row per (precision, feed, engine): the largest peak over the ranks, its split,
    and for DeepSpeed rows ours / it. Returns [] when DeepSpeed is not importable."""
    if importlib.util.find_spec("deepspeed") is None:
        return []
    rows: list[dict[str, Any]] = []
    for precision in precisions:
        engines = ENGINES if precision == "bf16" else ENGINES[:2]
        for feed in feeds:
            peaks = {name: measure_peaks(name, precision, m=m, batch=batch, labels=labels,
                                         default_buckets=default_buckets, feed=feed)
                     for name in engines}
            ours = max(rank.peak.total for rank in peaks["ours"])
            for name, ranks in peaks.items():
                worst = max(ranks, key=lambda rank: rank.peak.total)
                rows.append({"precision": precision, "feed": feed, "engine": name,
                             "worst": worst, "ranks": ranks, "ratio": None if name == "ours"
                             else ours / worst.peak.total})
    return rows


def _mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The summary (largest peak over ranks) and a per-rank table, Markdown."""
    lines = ["| precision | data | engine | peak / rank (MiB) | states | activations | other | "
             "states B/param | ours / it | goal ≤ 0.8× |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        worst: RankPeak = row["worst"]
        ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}"
        goal = "" if row["ratio"] is None else ("met" if row["ratio"] <= GOAL else "not met")
        lines.append(f"| {row['precision']} | {row['feed']} | {row['engine']} "
                     f"(rank {worst.rank}) | "
                     f"{_mib(worst.peak.total)} | {_mib(worst.peak.states)} | "
                     f"{_mib(worst.peak.activations)} | {_mib(worst.peak.other)} | "
                     f"{worst.peak.states / worst.parameters:.2f} | {ratio} | {goal} |")
    lines += ["", "| precision | data | engine | rank | stage | peak (MiB) | states | "
              "activations | other |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for rank in row["ranks"]:
            lines.append(f"| {row['precision']} | {row['feed']} | {row['engine']} | "
                         f"{rank.rank} | "
                         f"{rank.rank // DP} | {_mib(rank.peak.total)} | "
                         f"{_mib(rank.peak.states)} | {_mib(rank.peak.activations)} | "
                         f"{_mib(rank.peak.other)} |")
    return "\n".join(lines)


def _format_labels(rows: list[dict[str, Any]], top: int = 8) -> str:
    lines = []
    for row in rows:
        worst: RankPeak = row["worst"]
        lines.append(f"\n{row['precision']} {row['feed']} {row['engine']}, rank {worst.rank} "
                     f"at its peak "
                     f"(largest storages by kind, dtype and the op that made them):")
        for label, size in sorted(worst.labels.items(), key=lambda item: -item[1])[:top]:
            lines.append(f"  {_mib(size):>8} MiB  {label}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096, help="global batch (rows)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), action="append",
                        help="repeatable; default: bf16 and fp32")
    parser.add_argument("--feed", choices=FEEDS, action="append",
                        help="repeatable; default: both (module docstring)")
    parser.add_argument("--labels", action="store_true",
                        help="also list what each engine's peak is made of")
    parser.add_argument("--deepspeed-default-buckets", action="store_true",
                        help="leave DeepSpeed's ZeRO bucket sizes at its default (5e8 elements)")
    args = parser.parse_args(argv)
    started = time.time()
    rows = memory_rows(tuple(args.precision or ("bf16", "fp32")), m=args.microbatches,
                       batch=args.batch, labels=args.labels,
                       default_buckets=args.deepspeed_default_buckets,
                       feeds=tuple(args.feed or FEEDS))
    if not rows:
        print("DeepSpeed not installed: skipped (install it in its own venv: python -m venv "
              "--system-site-packages /work/venvs/dsmem && /work/venvs/dsmem/bin/pip install "
              "deepspeed==0.19.8)")
        return
    print(f"Peak live tensor bytes per rank, one step after a warm-up: pp{PP} × dp{DP}, ZeRO-1, "
          f"1F1B, m = {args.microbatches}, global batch {args.batch} (microbatch "
          f"{args.batch // (DP * args.microbatches)}), {DEPTH} × (Linear({WIDTH}), GELU), Adam; "
          f"torch {torch.__version__}; {time.time() - started:.0f} s")
    print(format_table(rows))
    if args.labels:
        print(_format_labels(rows))


if __name__ == "__main__":
    main()
