"""Step time of pipesched's engine against torch.distributed.pipelining and DeepSpeed, one run.

Every rank runs every framework in the same processes; at each m, every (schedule,
framework) pair takes one timed step per round, so machine noise (other jobs on shared
cores) hits all of them alike. Prints a
markdown table: median step time, the ratio ours/theirs, each schedule's time over 1F1B's
in the same framework (when 1f1b is in the run), and our measured makespan against the
simulator's prediction from the measured per-op costs.

torch runs its own class for a schedule where it has one (`TORCH_CLASSES`), and otherwise
(ZB-H1, ZB-H2, zb-auto) our schedule saved as its CSV on its `_PipelineScheduleRuntime`;
`interleaved-zb` is torch's ScheduleInterleavedZeroBubble, which we run from its own table.

    python benchmarks/bench_runtime.py                      # 4 ranks, m = 8 and 16
    python benchmarks/bench_runtime.py --schedules 1f1b zb-h1 zb-h2 zb-v interleaved-zb \
        --no-deepspeed                                      # zero bubble against 1F1B
    python benchmarks/bench_runtime.py --microbatches 8 --steps 5 --no-deepspeed
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_common import deepspeed_available, torch_schedule_step
from torch import nn

from pipeline import LayerSpec, PipelineEngine, PipelineModule, launch, torch_runtime, torch_stages
from pipeline.runtime.trace import measured_costs
from schedules import SCHEDULES, Schedule, figures, from_torch_rows, generate_schedule, simulate

__all__ = ["main"]

WIDTH, DEPTH, BATCH = 512, 32, 256
Step = Callable[[torch.Tensor, torch.Tensor], None]

TORCH_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                 "interleaved": "ScheduleInterleaved1F1B", "looped-bfs": "ScheduleLoopedBFS",
                 "zb-v": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV",
                 "interleaved-zb": "ScheduleInterleavedZeroBubble"}
"""Our schedule name -> torch's class running the same schedule."""
TORCH_ONLY = {"interleaved-zb": "interleaved"}
"""torch schedules we have no generator for -> our schedule with the same placement."""


def _layers() -> list[Any]:
    """32 × (Linear(512), GELU) as 64 layer entries."""
    layers: list[Any] = []
    for _ in range(DEPTH):
        layers += [LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.GELU)]
    return layers


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-4)


def _module(p: int, chunks: int) -> PipelineModule:
    return PipelineModule(_layers(), num_stages=p, chunks=chunks, loss_fn=F.mse_loss,
                          partition_method="uniform")


def _placed(schedule: str, m: int, p: int) -> Schedule:
    """Our compute-only schedule of that name (for a torch-only one: its placement)."""
    return generate_schedule(TORCH_ONLY.get(schedule, schedule), p, m)


def _ours(schedule: str | Schedule, m: int, p: int) -> tuple[Step, PipelineEngine]:
    chunks = schedule.chunks if isinstance(schedule, Schedule) else \
        SCHEDULES[schedule].default_chunks
    engine = PipelineEngine(_module(p, chunks), schedule=schedule, num_microbatches=m,
                            optimizer=_sgd)
    return (lambda x, y: engine.train_batch(x, y)), engine


def _torch(schedule: str, m: int, p: int, scratch: str) -> tuple[Step, str, Any]:
    """torch's step, what it ran, and its runner (whose table a torch-only schedule's
    `pipeline_order` is)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    placed = _placed(schedule, m, p)
    stages = torch_stages(_module(p, placed.chunks), placed)
    optimizer = _sgd([q for stage in stages for q in stage.submod.parameters()])
    class_name = TORCH_CLASSES.get(schedule)
    if class_name is None:  # no torch class: its runtime runs our schedule from our CSV
        runner: Any = torch_runtime(placed, stages, os.path.join(scratch, f"{schedule}.csv"),
                                    loss_fn=F.mse_loss)
        ran = "_PipelineScheduleRuntime + our CSV"
    else:
        cls = getattr(torch_schedules, class_name)
        single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
        runner = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=F.mse_loss)
        ran = class_name
    return torch_schedule_step(runner, stages, optimizer), ran, runner


def _torch_table(runner: Any, name: str, m: int) -> Schedule:
    """torch's compute-only table of `runner`, as our `Schedule`."""
    order = runner.pipeline_order
    return from_torch_rows([[None if a is None else str(a) for a in order[rank]]
                            for rank in sorted(order)], name=f"torch {name}", num_microbatches=m)


def _deepspeed(schedule: str, m: int, p: int) -> Step | None:
    if schedule != "1f1b":
        return None  # DeepSpeed's pipeline engine runs only its 1F1B
    import deepspeed
    from deepspeed.pipe import LayerSpec as DSLayerSpec
    from deepspeed.pipe import PipelineModule as DSPipelineModule

    deepspeed.init_distributed(dist_backend="gloo")
    layers = []
    for _ in range(DEPTH):
        layers += [DSLayerSpec(nn.Linear, WIDTH, WIDTH), DSLayerSpec(nn.GELU)]
    module = DSPipelineModule(layers=layers, num_stages=p, loss_fn=F.mse_loss,
                              partition_method="uniform")
    params = [q for q in module.parameters()]
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=_sgd(params), config={
        "train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // m,
        "gradient_accumulation_steps": m, "steps_per_print": 10**9})
    size = BATCH // m

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.train_batch(data_iter=iter([(x[k * size:(k + 1) * size], y[k * size:(k + 1) * size])
                                           for k in range(m)]))
    return step


def _timed(step: Step, x: torch.Tensor, y: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    step(x, y)
    dist.barrier()
    return time.perf_counter() - start


def _bench_rank(schedules: list[str], microbatches: list[int], steps: int, warmup: int,
                use_deepspeed: bool) -> list[dict[str, Any]]:
    p = dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    y = torch.randn(BATCH, WIDTH, generator=generator)
    with tempfile.TemporaryDirectory(prefix="bench-runtime-") as scratch:  # torch CSVs
        return [row for m in microbatches
                for row in _bench_at(m, p, schedules, steps, warmup, use_deepspeed, x, y,
                                     scratch)]


def _bench_at(m: int, p: int, schedules: list[str], steps: int, warmup: int,
              use_deepspeed: bool, x: torch.Tensor, y: torch.Tensor,
              scratch: str) -> list[dict[str, Any]]:
    """One row per schedule at m microbatches."""
    # every (schedule, framework) at this m takes one timed step per round, so the
    # ratios between frameworks and between schedules see the same machine noise
    contestants: list[tuple[str, str, Step]] = []
    engines: dict[str, PipelineEngine] = {}
    torch_ran: dict[str, str] = {}
    for schedule in schedules:
        torch_step, torch_ran[schedule], torch_runner = _torch(schedule, m, p, scratch)
        ours, engines[schedule] = _ours(_torch_table(torch_runner, schedule, m)
                                        if schedule in TORCH_ONLY else schedule, m, p)
        contestants += [(schedule, "ours", ours), (schedule, "torch", torch_step)]
        deepspeed_step = _deepspeed(schedule, m, p) if use_deepspeed else None
        if deepspeed_step is not None:
            contestants.append((schedule, "deepspeed", deepspeed_step))
    torch.set_num_threads(1)  # in case a framework changed it
    times: dict[tuple[str, str], list[float]] = {(s, f): [] for s, f, _ in contestants}
    measured: dict[str, list[float]] = {schedule: [] for schedule in schedules}
    predicted: dict[str, list[float]] = {schedule: [] for schedule in schedules}
    for round_index in range(warmup + steps):
        for schedule, framework, step in contestants:
            elapsed = _timed(step, x, y)
            if round_index < warmup:
                continue
            times[schedule, framework].append(elapsed)
            if framework == "ours":
                engine = engines[schedule]
                timeline = engine.last_timeline()
                costs = measured_costs(timeline).cost_model(engine.schedule.num_stages)
                measured[schedule].append(figures(timeline).makespan)
                predicted[schedule].append(figures(simulate(engine.schedule,
                                                            costs)).makespan)
    return [{"schedule": schedule, "m": m, "torch ran": torch_ran[schedule],
             **{framework: statistics.median(values)
                for (name, framework), values in times.items() if name == schedule},
             "measured": statistics.median(measured[schedule]),
             "predicted": statistics.median(predicted[schedule])}
            for schedule in schedules]


def _over_1f1b(rows: list[dict[str, Any]], row: dict[str, Any], framework: str) -> str:
    """This row's time over 1F1B's at the same m in the same framework ("n/a" without it)."""
    base = next((other[framework] for other in rows
                 if other["schedule"] == "1f1b" and other["m"] == row["m"]), None)
    return f"{row[framework] / base:.2f}" if base else "n/a"


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| schedule | m | ours (ms) | torch (ms) | ours/torch | ours ÷ 1F1B | torch ÷ 1F1B "
             "| torch ran | DeepSpeed (ms) | ours/DS | makespan measured / simulated |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ours, theirs = row["ours"] * 1e3, row["torch"] * 1e3
        ds = row.get("deepspeed")
        ds_cells = (f"{ds * 1e3:.1f} | {row['ours'] / ds:.2f}" if ds else "n/a | n/a")
        lines.append(f"| {row['schedule']} | {row['m']} | {ours:.1f} | {theirs:.1f} | "
                     f"{row['ours'] / row['torch']:.2f} | {_over_1f1b(rows, row, 'ours')} | "
                     f"{_over_1f1b(rows, row, 'torch')} | {row['torch ran']} | {ds_cells} | "
                     f"{row['measured'] * 1e3:.1f} / {row['predicted'] * 1e3:.1f} ms "
                     f"({row['measured'] / row['predicted'] - 1:+.0%}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "interleaved"],
                        choices=sorted({*SCHEDULES, *TORCH_ONLY} - {"forward-only"}),
                        metavar="NAME", help="registered schedules, or interleaved-zb "
                        "(torch's ScheduleInterleavedZeroBubble)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per framework")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-deepspeed", action="store_true")
    args = parser.parse_args(argv)
    use_deepspeed = deepspeed_available(not args.no_deepspeed, "comparing with torch only")
    started = time.time()
    rows = launch(_bench_rank, args.ranks, args.schedules, args.microbatches, args.steps,
                  args.warmup, use_deepspeed, timeout=600, threads_per_rank=1)[0]
    print(f"{args.ranks} ranks (gloo, 1 thread each), {DEPTH}×Linear({WIDTH})+GELU, batch "
          f"{BATCH}, medians of {args.steps} steps; torch {torch.__version__}; "
          f"{time.time() - started:.0f} s")
    print(_table(rows))


if __name__ == "__main__":
    main()
