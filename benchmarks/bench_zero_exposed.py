"""ZeRO-2 / 3 on emulated devices: exposed gather and reduce-scatter time, measured ÷ predicted.

Emulated layers (`pipeline.rehearsal.emulated`: F, I and W are timed waits) at pp1 × dp2 on two
CPU ranks, L layers of P fp32 parameters each, m microbatches, and an emulated link
(`pipeline.rehearsal.emulated_zero`, installed with `ShardedOptimizer.use_collectives`): each
reduce-scatter and all-gather is a timed wait on the rank's link, one at a time, priced by the
ring's bytes ((d-1)/d of the whole per link, at `--gbps`) plus d-1 hops of `--latency-us`.
So the cores stay free and what is measured is the engine's scheduling of its collectives
(what it overlaps, what it exposes), not gloo on a loaded host. Per configuration:

    measured exposed = fastest step (the link) − fastest step (a free link: each collective 0 s)
    predicted        = `schedules.analysis.zero_exposure.zero_exposed` at the same costs

ZeRO-2, and ZeRO-3 with prefetch and `reshard_after_forward` each on and off.

    PYTHONPATH=$PWD python benchmarks/bench_zero_exposed.py [--layers 4] [--params 262144]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.rehearsal.emulated import EmulatedCost, emulated_layers, emulated_loss
from pipeline.rehearsal.emulated_zero import EmulatedLinkCosts, EmulatedZeroCollectives, layer_costs
from schedules.analysis.zero_exposure import zero_exposed

__all__ = ["main"]

CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("ZeRO-2", {"zero_stage": 2}),
    ("ZeRO-3, prefetch, reshard", {"zero_stage": 3}),
    ("ZeRO-3, no prefetch, reshard", {"zero_stage": 3, "prefetch_next_unit": False}),
    ("ZeRO-3, prefetch, keep", {"zero_stage": 3, "reshard_after_forward": False}),
    ("ZeRO-3, no prefetch, keep", {"zero_stage": 3, "prefetch_next_unit": False,
                                   "reshard_after_forward": False}),
]
ROWS = 4
"""Rows per microbatch (each emulated op costs its time whatever the rows)."""


def _cost(args: argparse.Namespace) -> EmulatedCost:
    return EmulatedCost(forward=args.ms / 1e3, input_grad=args.ms / 1e3,
                        weight_grad=args.ms / 1e3, output_elements=8,
                        param_elements=args.params)


def _link(args: argparse.Namespace) -> EmulatedLinkCosts:
    return EmulatedLinkCosts(byte_seconds=1 / (args.gbps * 1e9),
                             latency=args.latency_us / 1e6)


def _fastest_step(args: argparse.Namespace, link: EmulatedLinkCosts,
                 options: dict[str, Any]) -> float:
    module = PipelineModule(emulated_layers([_cost(args)] * args.layers), num_stages=1,
                            loss_fn=emulated_loss, base_seed=None)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=args.microbatches,
                            data_parallel=2, timeout=120, bucket_mb=args.params * 4 / 2**20,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.0), **options)
    try:
        engine.optimizer.use_collectives(EmulatedZeroCollectives(link))
        x = torch.zeros(args.microbatches * ROWS, 1)
        engine.train_batch(x, x)  # warm-up: buffers, the clock's lateness
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(x, x)
            times.append(time.perf_counter() - start)
        return min(times)  # the host's load only ever adds: the fastest step is the nominal
    finally:
        engine.stop_watchdog()


def _measured(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    torch.set_num_threads(1)
    free = EmulatedLinkCosts(byte_seconds=0.0)
    return {name: (_fastest_step(args, _link(args), options),
                   _fastest_step(args, free, options)) for name, options in CONFIGS}


def _predicted(args: argparse.Namespace, options: dict[str, Any]) -> float:
    link = _link(args)
    layers = [layer_costs(_cost(args), link, 2, first=u == 0) for u in range(args.layers)]
    zero = options["zero_stage"]
    return zero_exposed(layers, zero_stage=zero, microbatches=args.microbatches,
                        prefetch=options.get("prefetch_next_unit", True),
                        reshard_after_forward=options.get("reshard_after_forward", True),
                        step_gather=[link.ring(args.params * 4, 2)] * args.layers
                        if zero == 2 else []).total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--params", type=int, default=2**18, help="fp32 parameters a layer")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--ms", type=float, default=10.0, help="F, I and W of a layer (ms)")
    parser.add_argument("--gbps", type=float, default=0.04,
                        help="link bandwidth (GB/s): 0.04 makes a layer's gather 1.4 F")
    parser.add_argument("--latency-us", type=float, default=500.0, help="per ring hop (µs)")
    parser.add_argument("--steps", type=int, default=7, help="timed steps a configuration")
    args = parser.parse_args()
    ranks = launch(_measured, 2, args, join_timeout=1800)
    link = _link(args)
    print(f"\n## ZeRO-2/3 exposed communication on emulated devices (pp1 × dp2, {args.layers} "
          f"layers × {args.params:,} fp32 parameters, m = {args.microbatches}, F = I = W = "
          f"{args.ms:g} ms; emulated link {args.gbps:g} GB/s, {args.latency_us:g} µs a hop: "
          f"a layer's gather or reduce-scatter {link.ring(args.params * 4, 2) * 1e3:.2f} "
          f"ms)\n")
    print("| configuration | step (ms) | free-link step (ms) | measured exposed (ms) | "
          "predicted (ms) | measured ÷ predicted |")
    print("|---|---|---|---|---|---|")
    for name, options in CONFIGS:
        step = max(rank[name][0] for rank in ranks)
        free = max(rank[name][1] for rank in ranks)
        predicted = _predicted(args, options)
        print(f"| {name} | {step * 1e3:.1f} | {free * 1e3:.1f} | {(step - free) * 1e3:.1f} | "
              f"{predicted * 1e3:.1f} | {(step - free) / predicted:.3f} |")


if __name__ == "__main__":
    main()
