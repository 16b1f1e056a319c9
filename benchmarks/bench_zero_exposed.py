"""ZeRO-2 / 3 on emulated devices: exposed gather and reduce-scatter time, measured ÷ predicted.

Emulated layers (`pipeline.rehearsal.emulated`: F, I and W are timed waits, the core stays
free) at pp1 × dp2 on two CPU ranks, L layers of P fp32 parameters each, m microbatches. The
collectives are real gloo ones; their price comes from the planner's own formulas
(`pipeline.planner.data_parallel`: `sharded_comm_seconds`, ZeRO-1's gather `_gather_seconds`)
fed a link measured in the same processes: the median time of `all_gather_single` over the
dp pair at two sizes gives latency α and bandwidth β of the planner's ring form
(t = α + n / 2β for d = 2). Per configuration:

    measured exposed = median step time (dp2, ZeRO-k) − median step time (one rank, no dp)
    predicted        = what the planner prices exposed for ZeRO-k beyond the compute:
        ZeRO-2       (m − 1) reduce-scatters (priced exposed, an upper bound) + the last
                     backward's reduce-scatter + ZeRO-1's all-gather of the stage after the step
        ZeRO-3       the same reduce-scatters + 2·m·L per-layer gathers (no prefetch)

Run with prefetch off (the planner's assumption: every gather blocks its op) and on (the
engine's default; the planner does not credit it). Also the seconds a step spends inside
ZeRO-3's `gather` calls (launch + wait, the exposed part of each gather) beside their price:
where a gap comes from the collectives themselves rather than from unpriced exposure.

    PYTHONPATH=$PWD python benchmarks/bench_zero_exposed.py [--layers 4] [--params 262144]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.parallel.zero3 import FullyShardedOptimizer
from pipeline.planner.cluster import PRESETS
from pipeline.planner.data_parallel import _gather_seconds, sharded_comm_seconds
from pipeline.planner.pricing import allreduce_seconds
from pipeline.rehearsal.emulated import EmulatedCost, emulated_layers, emulated_loss

__all__ = ["main"]

CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("ZeRO-2", {"zero_stage": 2}),
    ("ZeRO-3, no prefetch", {"zero_stage": 3, "prefetch_next_unit": False}),
    ("ZeRO-3, prefetch", {"zero_stage": 3}),
]
ROWS = 4
"""Rows per microbatch (each emulated op costs its time whatever the rows)."""


def _module(args: argparse.Namespace) -> PipelineModule:
    cost = EmulatedCost(forward=args.ms / 1e3, input_grad=args.ms / 1e3,
                        weight_grad=args.ms / 1e3, output_elements=8,
                        param_elements=args.params)
    return PipelineModule(emulated_layers([cost] * args.layers), num_stages=1,
                          loss_fn=emulated_loss, base_seed=None)


def _median_step(engine: PipelineEngine, m: int, steps: int) -> float:
    x = torch.zeros(m * ROWS, 1)
    engine.train_batch(x, x)  # warm-up: buffers, first gathers
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        engine.train_batch(x, x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _engine(args: argparse.Namespace, dp: int, **options: Any) -> PipelineEngine:
    return PipelineEngine(_module(args), schedule="1f1b", num_microbatches=args.microbatches,
                          data_parallel=dp, timeout=120, bucket_mb=args.params * 4 / 2**20,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.0), **options)


def _compute_only(args: argparse.Namespace) -> float:
    engine = _engine(args, 1)
    try:
        return _median_step(engine, args.microbatches, args.steps)
    finally:
        engine.stop_watchdog()


def _gather_time(elements: int, group: dist.ProcessGroup, repeats: int) -> float:
    """Median seconds of one all_gather_single of `elements` fp32 elements over `group`."""
    size = dist.get_world_size(group)
    out, mine = torch.zeros(elements), torch.ones(elements // size)
    times = []
    for _ in range(repeats):
        dist.barrier(group)
        start = time.perf_counter()
        dist.all_gather_single(out, mine, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measured(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    group = dist.new_group([0, 1])
    small, large = args.params // 8, args.params
    link = (_gather_time(small, group, 30), _gather_time(large, group, 30))
    steps, waits = {}, {}
    for name, options in CONFIGS:
        engine = _engine(args, 2, **options)
        waited = _time_gathers(engine.optimizer)
        steps[name] = _median_step(engine, args.microbatches, args.steps)
        waits[name] = waited[0] / (args.steps + 1)  # warm-up step included
        engine.stop_watchdog()
    return {"link": link, "steps": steps, "gather_waits": waits}


def _time_gathers(optimizer: object) -> list[float]:
    """Seconds a step spends inside ZeRO-3's blocking `gather` calls (launch + wait), summed
    into the returned cell (stays 0 for ZeRO-2)."""
    total = [0.0]
    if isinstance(optimizer, FullyShardedOptimizer):
        gather = optimizer.gather

        def timed(key: int) -> None:
            start = time.perf_counter()
            gather(key)
            total[0] += time.perf_counter() - start
        optimizer.gather = timed  # type: ignore[method-assign]
    return total


def _cluster(small: float, large: float, args: argparse.Namespace) -> Any:
    """A one-node cluster whose link is the measured one, in the planner's ring form for
    d = 2 (all-gather = half a ring all-reduce: α + n / 2β)."""
    n_small, n_large = 4 * args.params / 8, 4 * args.params
    bandwidth = (n_large - n_small) / (2 * max(large - small, 1e-9))
    latency = max(small - n_small / (2 * bandwidth), 0.0)
    return dataclasses.replace(PRESETS["h100-80g"], intra_bandwidth=bandwidth,
                               intra_latency=latency, link_efficiency=1.0, nodes=1)


def _predicted(name: str, args: argparse.Namespace, cluster: Any) -> float:
    stage_params, m, layers = args.params * args.layers, args.microbatches, args.layers
    zero = 3 if name.startswith("ZeRO-3") else 2
    extra = float(sharded_comm_seconds(np.array([stage_params]), [layers], [0], cluster, dp=2,
                                       tp=1, zero_stage=zero, num_microbatches=m,
                                       grad_reduce_bytes=4)[0])
    last_reduce = allreduce_seconds(stage_params * 4, 2, 1, cluster) / 2  # ZeRO-1's
    after_step = _gather_seconds(stage_params, 2, 1, cluster) if zero == 2 else 0.0
    return extra + last_reduce + after_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--params", type=int, default=2**18, help="fp32 parameters a layer")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--ms", type=float, default=10.0, help="F, I and W of a layer (ms)")
    parser.add_argument("--steps", type=int, default=7, help="timed steps a configuration")
    args = parser.parse_args()
    compute = launch(_compute_only, 1, args, join_timeout=900)[0]
    ranks = launch(_measured, 2, args, join_timeout=1800)
    small, large = (max(rank["link"][k] for rank in ranks) for k in (0, 1))
    cluster = _cluster(small, large, args)
    print(f"\n## ZeRO-2/3 exposed communication on emulated devices (pp1 × dp2, {args.layers} "
          f"layers × {args.params:,} fp32 parameters, m = {args.microbatches}, F = I = W = "
          f"{args.ms:g} ms)\n")
    print(f"compute-only step {compute * 1e3:.1f} ms; link from gloo all_gather_single: "
          f"α = {cluster.intra_latency * 1e6:.0f} µs, β = {cluster.intra_bandwidth / 1e9:.2f} "
          f"GB/s (gathers of {4 * args.params / 8 / 1024:.0f} KiB: {small * 1e3:.2f} ms, "
          f"{4 * args.params / 1024:.0f} KiB: {large * 1e3:.2f} ms)\n")
    print("| configuration | step (ms) | measured exposed (ms) | predicted (ms) | "
          "measured ÷ predicted | in gather calls (ms/step) | their price (ms/step) |")
    print("|---|---|---|---|---|---|---|")
    for name, _ in CONFIGS:
        step = max(rank["steps"][name] for rank in ranks)
        exposed, predicted = step - compute, _predicted(name, args, cluster)
        waited = max(rank["gather_waits"][name] for rank in ranks)
        priced = (2 * args.microbatches * args.layers * _gather_seconds(args.params, 2, 1, cluster)
                  if name.startswith("ZeRO-3") else 0.0)
        print(f"| {name} | {step * 1e3:.1f} | {exposed * 1e3:.1f} | {predicted * 1e3:.1f} | "
              f"{exposed / predicted:.2f} | {waited * 1e3:.1f} | {priced * 1e3:.1f} |")


if __name__ == "__main__":
    main()
