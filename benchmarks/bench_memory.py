"""Memory benchmark: model states. Bytes per parameter at the optimizer step, exposed gradient
reduction with and without overlap, and bf16 half parameters' loss curve against fp32.

Section "states": live tensor bytes per owned parameter, counted right after a training step
(`pipeline.parallel.model_state`), for fp32 / bf16 / fp16 × ZeRO 0 / 1 × d ∈ {1, 2, 4},
beside Megatron-Core's distributed-optimizer formula (its docs): fp32 16 → 8 + 8/d, bf16
18 → 6 + 12/d, fp16 20 → 4 + 16/d. Model of issue 20: 16 × Linear(512), Adam, one stage per
rank (p = 1, dp = d). bf16 / fp16 run with autocast over fp32 parameters without ZeRO (16 B,
leaner than Megatron's 18 / 20) and with `half_parameters` under ZeRO-1.

Section "overlap": seconds per step spent in REDUCE_GRAD and in STEP's wait for the
reductions (`StepStats.exposed_reduction`), plain dp and ZeRO-1, with and without
`overlap_grad_reduce`, p = 1 (the whole reduction follows the last backward), and blocked on
ZeRO-1's parameter all-gathers (`StepStats.exposed_gather`: at STEP, or with
`overlap_param_gather` in the next step's forwards), same processes, steps in turn; beside
the exposed reduction and gather the simulator's predictions (`schedules.GradReduction`,
`schedules.ParamGather`, the rules the planner prices) from the step's measured F and B times
and the buckets' collectives timed alone in the same processes.

Section "bf16-curve": the demo language model (pp 2 × dp 2, ZeRO-1, 1F1B, Adam) for 100
steps in fp32 and in bf16 with half parameters, same processes, same data; the largest
relative gap between the two loss curves.

Sections "freeing", "recompute", "predicted" (activation memory; `memory_activations.py`):
rank 0's peak with and without stage-output freeing, recomputation modes (memory and time), and
the one accounting's predicted activation bytes against counted ones. Section "deepspeed"
(`bench_memory_deepspeed.py`): peak per rank against DeepSpeed's pipeline engine, where
DeepSpeed is installed.

    PYTHONPATH=$PWD python benchmarks/bench_memory.py [--section states|overlap|bf16-curve]

Counted bytes are exact and repeatable; times are medians on a shared CPU and noisy: compare
only within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from memory_activations import ACTIVATION_SECTIONS
from torch import nn

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.demo.language_model import TinyLMConfig, lm_layers, lm_loss, synthetic_batch
from pipeline.parallel.model_state import count_model_states
from pipeline.runtime.trace import measured_costs
from schedules import GradReduction, ParamGather, figures, simulate

__all__ = ["bf16_curve_section", "model_state_rows", "overlap_rows", "overlap_section",
           "states_section"]

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
            num_microbatches: int = 2, overlap_gather: bool = False) -> PipelineEngine:
    module = PipelineModule(_layers(), num_stages=1, loss_fn=F.mse_loss)
    return PipelineEngine(module, optimizer=_adam, num_microbatches=num_microbatches,
                          zero_stage=zero, precision=precision,
                          half_parameters=zero == 1 and precision != "fp32",
                          overlap_grad_reduce=overlap, bucket_mb=bucket_mb,
                          overlap_param_gather=overlap_gather)


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

def _bucket_seconds(zero: int, numel: int, bucket_mb: float, repeats: int = 5) -> float:
    """Seconds of one stage's bucket reductions back to back, as the engine issues them on
    gloo with their host work: all_reduce of a flattened, divided copy, then the copy back;
    ZeRO-1: all_to_all of each bucket's divided shard slices, then their sum. The median of
    `repeats` (collective over the world, the dp group here)."""
    world = dist.get_world_size()
    per_bucket = max(world, int(bucket_mb * 2**20) // 4 // world * world)
    flat = torch.zeros(-(-numel // world) * world)
    buckets = [flat[lo:lo + per_bucket] for lo in range(0, len(flat), per_bucket)]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        for bucket in buckets:
            if zero:
                sent = bucket.view(world, -1).contiguous().div_(world)
                received = torch.empty_like(sent)
                work = dist.all_to_all_single(received, sent, async_op=True)
            else:
                received = bucket.clone().div_(world)
                work = dist.all_reduce(received, async_op=True)
            pending.append((work, received, bucket))
        for work, received, bucket in pending:
            work.wait()
            if zero:
                torch.sum(received, dim=0)
            else:
                bucket.copy_(received)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gather_seconds(numel: int, bucket_mb: float, repeats: int = 5) -> float:
    """Seconds of one stage's parameter all-gathers back to back, as the engine issues them
    (`pipeline.parallel.param_gather`: one async all_gather per bucket into views of the
    flat buffer, from a copy of the rank's piece, then the waits). The median of `repeats`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_bucket = max(world, int(bucket_mb * 2**20) // 4 // world * world)
    flat = torch.zeros(-(-numel // per_bucket) * per_bucket)
    piece = per_bucket // world
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        pending = []
        for lo in range(0, len(flat), per_bucket):
            outputs = [flat[lo + q * piece:lo + (q + 1) * piece] for q in range(world)]
            mine = outputs[rank].clone()
            pending.append((dist.all_gather(outputs, mine, async_op=True), mine))
        for work, _ in pending:
            work.wait()  # type: ignore[union-attr]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


OVERLAP_CONFIGS = [(0, False, False), (0, True, False), (1, False, False), (1, True, False),
                   (1, True, True)]
"""(ZeRO stage, overlap_grad_reduce, overlap_param_gather) per row of the overlap section."""


def _measure_overlap(steps: int, rounds: int = 2, bucket_mb: float = 1.0) -> list[list[float]]:
    """Per configuration: [exposed reduction, exposed gather, step, simulated exposed
    reduction, simulated exposed gather] seconds, median over steps, mean over ranks; the
    configurations take turns in the same processes, `steps` consecutive steps each per round
    (consecutive: an overlapped gather must be waited for by the same engine's next forward,
    not hidden behind another engine's step)."""
    world = dist.get_world_size()
    engines = [_engine("fp32", zero, overlap=overlap, bucket_mb=bucket_mb, num_microbatches=4,
                       overlap_gather=gather) for zero, overlap, gather in OVERLAP_CONFIGS]
    numel = sum(p.numel() for p in engines[0].module.parameters())
    buckets = max(1, -(-numel * 4 // int(bucket_mb * 2**20)))
    torch.manual_seed(2)
    x, y = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
    measured: list[list[list[float]]] = [[[], [], [], [], []] for _ in OVERLAP_CONFIGS]
    for _ in range(rounds):
        reduce = {zero: _bucket_seconds(zero, numel, bucket_mb) for zero in (0, 1)}
        gathered = _gather_seconds(numel, bucket_mb)
        for index, engine in enumerate(engines):
            zero, overlap, overlap_gather = OVERLAP_CONFIGS[index]
            for k in range(steps // rounds + 1):
                engine.train_batch(x, y)
                stats = engine.last_stats
                if k and stats is not None:  # the first step of a turn warms up
                    costs = measured_costs(engine.last_timeline()).cost_model(1)
                    reduction = GradReduction(time=reduce[zero], buckets=buckets,
                                              start="overlap" if overlap else "after_backward")
                    # ZeRO-1's gathers in the reduction's buckets, each of the stage's layers
                    # waiting for its own (`schedules.analysis.gather`)
                    gather = ParamGather(time=gathered, buckets=buckets, overlap=overlap_gather,
                                         layers=LAYERS) if zero else None
                    predicted = figures(simulate(engine.schedule, replace(
                        costs, reduction=reduction, gather=gather)))
                    for column, value in enumerate((
                            stats.exposed_reduction, stats.exposed_gather, stats.step_time,
                            predicted.exposed_reduction[0],
                            predicted.exposed_gather[0] if zero else 0.0)):
                        measured[index][column].append(value)
    mine = torch.tensor([[statistics.median(column) for column in row] for row in measured],
                        dtype=torch.float64)
    dist.all_reduce(mine)  # the mean over ranks
    for engine in engines:
        engine.stop_watchdog()
    return (mine / world).tolist()


def overlap_rows(world: int = 2, steps: int = 10) -> list[str]:
    """The markdown rows of the exposed-reduction section."""
    rows = launch(_measure_overlap, world, steps, join_timeout=1800)[0]
    lines = [f"fp32, p = 1, dp = {world}, m = 4, 1 MiB buckets, {LAYERS} × Linear({WIDTH}), "
             f"Adam; median over {steps} steps, mean over ranks. Simulated: the step's own "
             "measured F and B, the buckets' reductions (with their host work) and "
             "all-gathers timed alone just before; measured times on a shared 2-core CPU are "
             "noisy (compare within one run)",
             "| ZeRO | overlap_grad_reduce | overlap_param_gather | exposed reduction (ms/step) "
             "| simulated (ms/step) | exposed gather (ms/step) | simulated (ms/step) "
             "| step (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for (zero, overlap, gather), (exposed, gathered, step, simulated, simulated_gather) in zip(
            OVERLAP_CONFIGS, rows):
        lines.append(f"| {zero} | {overlap} | {gather if zero else '-'} | {exposed * 1e3:.1f} "
                     f"| {simulated * 1e3:.1f} | {gathered * 1e3:.1f} "
                     f"| {simulated_gather * 1e3:.1f} | {step * 1e3:.1f} |")
    return lines


def states_section() -> None:
    print("\n## Model states at the optimizer step (live bytes per owned parameter)\n")
    print("\n".join(model_state_rows()), flush=True)


def overlap_section() -> None:
    print("\n## Exposed gradient reduction per step\n")
    print("\n".join(overlap_rows()), flush=True)


# -- section: bf16 half parameters' loss curve against fp32 ---------------------------------

def _curves(steps: int) -> dict[str, list[float]]:
    config = TinyLMConfig()
    engines = {}
    for name, options in (("fp32", {}), ("bf16", {"precision": "bf16",
                                                  "half_parameters": True})):
        module = PipelineModule(lm_layers(config), num_stages=2, loss_fn=lm_loss,
                                base_seed=7)
        engines[name] = PipelineEngine(module, optimizer=lambda ps: torch.optim.Adam(
            ps, lr=3e-3), num_microbatches=4, data_parallel=2, zero_stage=1, **options)
    curves: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(steps):
        inputs, targets = synthetic_batch(step, 32, config)
        for name, engine in engines.items():
            dp_rank = engine.position.dp_rank
            local = slice(dp_rank * 16, (dp_rank + 1) * 16)
            curves[name].append(engine.train_batch(inputs[local], targets[local]))
    for engine in engines.values():
        engine.stop_watchdog()
    return curves


def bf16_curve_section(steps: int = 100) -> None:
    curves = launch(_curves, 4, steps, join_timeout=1800)[0]
    gaps = [abs(b - f) / f for f, b in zip(curves["fp32"], curves["bf16"])]
    print(f"\n## bf16 half parameters against fp32: demo LM, pp2 × dp2, ZeRO-1, {steps} "
          f"steps\n")
    print("| step | fp32 loss | bf16 loss | relative gap |\n|---|---|---|---|")
    for step in sorted({0, 9, 24, 49, 74, steps - 1}):
        print(f"| {step + 1} | {curves['fp32'][step]:.4f} | {curves['bf16'][step]:.4f} | "
              f"{gaps[step]:.2%} |")
    print(f"\nlargest relative gap {max(gaps):.2%} (step {gaps.index(max(gaps)) + 1}); "
          f"mean {statistics.mean(gaps):.2%}", flush=True)


def deepspeed_section() -> None:
    from bench_memory_deepspeed import main as deepspeed_main
    deepspeed_main([])


SECTIONS: dict[str, Callable[[], None]] = {
    "states": states_section, "overlap": overlap_section, "bf16-curve": bf16_curve_section,
    **ACTIVATION_SECTIONS, "deepspeed": deepspeed_section}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", choices=sorted(SECTIONS), action="append",
                        help="run only this section (repeatable); default: all")
    for name in parser.parse_args().section or list(SECTIONS):
        SECTIONS[name]()


if __name__ == "__main__":
    main()
