"""Memory at the peers' level: bytes per parameter at the optimizer step, and exposed reduction.

Section "model states" (`model_state_rows`): live tensor bytes per owned parameter, counted
right after a training step (`pipeline.parallel.model_state`), for fp32 / bf16 / fp16 ×
ZeRO 0 / 1 × d ∈ {1, 2, 4}, beside Megatron-Core's distributed-optimizer formula (its docs):
fp32 16 → 8 + 8/d, bf16 18 → 6 + 12/d, fp16 20 → 4 + 16/d. Model of issue 20: 16 ×
Linear(512), Adam, one stage per rank (p = 1, dp = d). bf16 / fp16 run with autocast over
fp32 parameters without ZeRO (16 B, leaner than Megatron's 18 / 20) and with
`half_parameters` under ZeRO-1.

Section "exposed reduction" (`overlap_rows`): seconds per step spent in REDUCE_GRAD and in
STEP's wait for the reductions (`StepStats.exposed_reduction`), ZeRO-1, with and without
`overlap_grad_reduce`, same processes, alternating steps. Timings are noisy on a shared
machine: compare only within one run.

    python benchmarks/bench_memory.py                     # both sections
    python benchmarks/bench_memory.py --section states
    python benchmarks/bench_memory.py --section overlap --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.parallel.model_state import count_model_states

WIDTH, LAYERS = 512, 16
PRECISIONS = ("fp32", "bf16", "fp16")
MEGATRON = {  # bytes per parameter with Adam: (without, with the distributed optimizer)
    "fp32": (lambda d: 16.0, lambda d: 8 + 8 / d),
    "bf16": (lambda d: 18.0, lambda d: 6 + 12 / d),
    "fp16": (lambda d: 20.0, lambda d: 4 + 16 / d),
}


def _layers(width: int = WIDTH, layers: int = LAYERS) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(width, width) for _ in range(layers)]


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


def _engine(precision: str, zero: int, *, overlap: bool = True, bucket_mb: float = 25.0,
            num_microbatches: int = 2) -> PipelineEngine:
    module = PipelineModule(_layers(), num_stages=1, loss_fn=F.mse_loss)
    return PipelineEngine(module, optimizer=_adam, num_microbatches=num_microbatches,
                          zero_stage=zero, precision=precision,
                          half_parameters=zero == 1 and precision != "fp32",
                          overlap_grad_reduce=overlap, bucket_mb=bucket_mb)


# -- section: model states ------------------------------------------------------------------

def _measure_states() -> list[tuple[str, int, float]]:
    """On every rank: (precision, ZeRO stage, bytes per owned parameter) after one step."""
    rows = []
    for precision in PRECISIONS:
        for zero in (0, 1):
            engine = _engine(precision, zero)
            torch.manual_seed(1)
            x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
            engine.train_batch(x, y)
            counted = count_model_states(engine.module, engine.optimizer)
            rows.append((precision, zero, counted.per_parameter))
            engine.stop_watchdog()
    return rows


def model_state_rows(ranks: tuple[int, ...] = (1, 2, 4)) -> list[str]:
    """The markdown rows of the model-states section (one launch per d)."""
    lines = ["| precision | ZeRO | d | ours (B/param) | Megatron (B/param) | ours / Megatron |",
             "|---|---|---|---|---|---|"]
    for world in ranks:
        rows = launch(_measure_states, world, join_timeout=900)[0]
        for precision, zero, ours in rows:
            megatron = MEGATRON[precision][zero](world)
            mode = "" if precision == "fp32" else (" (half params)" if zero else " (autocast)")
            lines.append(f"| {precision}{mode} | {zero} | {world} | {ours:.2f} | "
                         f"{megatron:.2f} | {ours / megatron:.3f} |")
    return lines


# -- section: exposed reduction -------------------------------------------------------------

def _measure_overlap(steps: int) -> list[list[float]]:
    """[exposed, step] seconds (median over steps, mean over ranks) without / with overlap."""
    world = dist.get_world_size()
    engines = {overlap: _engine("fp32", 1, overlap=overlap, bucket_mb=1.0, num_microbatches=4)
               for overlap in (False, True)}
    torch.manual_seed(2)
    x, y = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
    exposed: dict[bool, list[float]] = {False: [], True: []}
    step: dict[bool, list[float]] = {False: [], True: []}
    for k in range(steps + 1):
        for overlap, engine in engines.items():
            engine.train_batch(x, y)
            stats = engine.last_stats
            if k and stats is not None:  # the first step warms up
                exposed[overlap].append(stats.exposed_reduction)
                step[overlap].append(stats.step_time)
    mine = torch.tensor([[statistics.median(exposed[o]), statistics.median(step[o])]
                         for o in (False, True)], dtype=torch.float64)
    dist.all_reduce(mine)  # the mean over ranks
    for engine in engines.values():
        engine.stop_watchdog()
    return (mine / world).tolist()


def overlap_rows(world: int = 2, steps: int = 10) -> list[str]:
    """The markdown rows of the exposed-reduction section."""
    rows = launch(_measure_overlap, world, steps, join_timeout=1800)[0]
    lines = [f"ZeRO-1 fp32, p = 1, dp = {world}, m = 4, 1 MiB buckets, 16 × Linear({WIDTH}); "
             f"median over {steps} steps, mean over ranks",
             "| overlap_grad_reduce | exposed reduction (ms/step) | step (ms) |",
             "|---|---|---|"]
    for overlap, (exposed, step) in zip((False, True), rows):
        lines.append(f"| {overlap} | {exposed * 1e3:.1f} | {step * 1e3:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=("states", "overlap", "all"), default="all")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.section in ("states", "all"):
        print("\n## Model states at the optimizer step (live bytes per owned parameter)\n")
        print("\n".join(model_state_rows()))
    if args.section in ("overlap", "all"):
        print("\n## Exposed gradient reduction per step\n")
        print("\n".join(overlap_rows(steps=args.steps)))


if __name__ == "__main__":
    main()
