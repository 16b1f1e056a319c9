"""`pipesched plan` measured, not asserted: the planner's predictions against real runs of
every configuration in a small space on 2 CPU ranks, and the planner's own search time on a
64-device cluster. Prints each target as met or not met.

Real runs: the demo language model (pipeline/demo/language_model.py), profiled per layer
in this process, the `local` cluster calibrated over gloo; every configuration is then run
on 2 ranks (gloo, 1 thread each) with the planner's partition: one warm-up step, then one
step of each configuration per round for --rounds rounds, keeping each one's fastest (the
slowest rank's); profiles and calibration keep their fastest runs too, so load from other
processes on a shared machine disturbs prediction and measurement alike. Memory per rank is
measured from the tensors: parameters, gradients (ZeRO-1's flat buffers included), the
optimizer's state, and the peak of bytes autograd holds for the backward during a step
(saved-tensor hooks, storages counted once, parameters excluded).

Emulated devices (`benchmarks/plan_emulated.py`, its docstring says how): a small
transformer's per-layer costs on 4 and 8 ranks whose layers wait their planned F, I and W.

    python benchmarks/bench_plan.py                    # every part
    python benchmarks/bench_plan.py --part search      # the 64-device search time only
    python benchmarks/bench_plan.py --part emulated --devices 4
    python benchmarks/bench_plan.py --part published   # Megatron-LM's Table 1 (bench_published.py)
    python benchmarks/bench_plan.py --part scale       # a 1T shape on 3,072 devices
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np

from pipeline.planner import (
    PRESETS,
    PlanConfig,
    SearchOptions,
    parse_shape,
    plan,
    transformer_profile,
)

__all__ = ["main"]

MIB = 2**20
SEARCH_SHAPE = "layers=32,hidden=4096,heads=32,vocab=32000,seq=2048"
BENCH_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
BATCH = 32


def search_time() -> tuple[float, float, str]:
    """Wall and CPU seconds of a full search: a 7B-parameter shape on 8 × 8 A100s."""
    model = transformer_profile(parse_shape(SEARCH_SHAPE))
    cluster = replace(PRESETS["a100-80g"], nodes=8)
    wall, cpu = time.perf_counter(), time.process_time()
    result = plan(model, cluster, 512)
    return (time.perf_counter() - wall, time.process_time() - cpu,
            f"{result.considered} configurations, {len(result.predictions)} simulated")


SCALE_SHAPE = "layers=128,hidden=25600,heads=160,vocab=51200,seq=2048"


def scale_search() -> str:
    """The full search (every schedule, ZeRO, recomputation) of a 1T shape on 3,072 A100s,
    global batch 3,072: CPU seconds and the process's peak resident memory."""
    import resource

    model = transformer_profile(parse_shape(SCALE_SHAPE))
    cluster = replace(PRESETS["a100-80g"], nodes=384)
    wall, cpu = time.perf_counter(), time.process_time()
    result = plan(model, cluster, 3072)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return (f"search at scale, {SCALE_SHAPE} on 384 × 8 a100-80g, global batch 3072: "
            f"{result.considered} configurations, {len(result.predictions)} simulated, "
            f"{result.stopped_early} stopped early (beaten partway), pick "
            f"{result.best.config.label()}; {cpu:.1f} s CPU, {wall:.1f} s wall, peak "
            f"{peak:.0f} MiB -> CPU {_met(cpu <= 10)} (target <= 10 s), memory "
            f"{_met(peak <= 500)} (target <= 500 MB)")


def _state_bytes(module: Any, engine: Any) -> int:
    """Bytes of parameters, gradients and optimizer state of this rank, storages once: the
    module's parameters and gradients, the optimizer's state tensors, and under ZeRO-1 the
    sharded optimizer's flat gradient buffers and shards (read from its regions)."""
    import torch

    tensors = [p for p in module.parameters()]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    optimizer = engine.optimizer
    for region in getattr(optimizer, "_regions", {}).values():
        tensors += [region.flat_param, region.flat_grad, region.master]
        if region.master.grad is not None:  # the shard's gradient: a view of flat_grad in fp32
            tensors.append(region.master.grad)
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in getattr(inner, "state", {}).values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _snapshot_before_step(module: Any, engine: Any) -> None:
    """Record the state bytes right before each optimizer step in `engine.state_at_step`."""
    optimizer = engine.optimizer
    step = optimizer.step
    engine.state_at_step = 0

    def measured_step(*args: Any, **kwargs: Any) -> Any:
        engine.state_at_step = max(engine.state_at_step, _state_bytes(module, engine))
        return step(*args, **kwargs)

    optimizer.step = measured_step


def run_configs(configs: list[dict[str, Any]], model_config: Any, rounds: int
                ) -> list[dict[str, Any]]:
    """On every rank: build every configuration's engine, then time one step of each per
    round, `rounds` times over (so load from other processes falls on all alike), keep the
    fastest; then measure each one's memory during one more step."""
    import torch
    import torch.distributed as dist

    from pipeline import PipelineEngine, PipelineModule
    from pipeline.demo.language_model import lm_layers, lm_loss, synthetic_batch
    from pipeline.runtime.saved_memory import SavedTensorMeter

    torch.set_num_threads(1)
    inputs, targets = synthetic_batch(0, BATCH, model_config)
    runs: list[tuple[Any, Any, Any, list[float]]] = []
    for item in configs:
        config: PlanConfig = item["config"]
        module = PipelineModule(lm_layers(model_config), num_stages=config.pp,
                                chunks=config.chunks, loss_fn=lm_loss,
                                partition_method=list(item["boundaries"]),
                                recompute=config.recompute,
                                recompute_layers=config.recompute_layers or None)
        engine = PipelineEngine(module, schedule=config.schedule,
                                num_microbatches=config.num_microbatches,
                                data_parallel=config.dp, zero_stage=config.zero_stage,
                                optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
        engine.stop_watchdog()  # many engines polling the store would load the 2 cores
        replica = engine.position.dp_rank
        rows = slice(replica * BATCH // config.dp, (replica + 1) * BATCH // config.dp)
        engine.train_batch(inputs[rows], targets[rows])  # warm-up: shapes, buffers
        runs.append((module, engine, rows, []))
        # gradients are whole only at the optimizer step (ZeRO-1 frees them after it)
        _snapshot_before_step(module, engine)
    for _ in range(rounds):
        for _module, engine, rows, times in runs:
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(inputs[rows], targets[rows])
            times.append(time.perf_counter() - start)
    results = []
    for module, engine, rows, times in runs:
        held = SavedTensorMeter(ignore=list(module.parameters()))
        with held:
            engine.train_batch(inputs[rows], targets[rows])
        state = max(engine.state_at_step, _state_bytes(module, engine))
        results.append({"seconds": min(times), "memory": state + held.peak,
                        "activations": held.peak})
    return results


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected among float timings)."""
    rank_a, rank_b = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(rank_a, rank_b)[0, 1])


def local_part(rounds: int) -> list[str]:
    """Plan the demo model on 2 local ranks, run every configuration, compare."""
    import torch

    from pipeline import launch
    from pipeline.demo.language_model import TinyLMConfig, lm_layers, synthetic_batch
    from pipeline.planner.calibrate import calibrate_local, profile_layers

    model_config = TinyLMConfig(vocab=256, width=128, heads=4, blocks=6, seq_len=64)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = profile_layers(lm_layers(model_config),
                           lambda b: synthetic_batch(0, b, model_config)[0], batches=(2, 16),
                           repeats=1, rounds=10, name="demo LM", seq=model_config.seq_len)
    cluster = calibrate_local(ranks=2)
    calibration = (f"local calibration: P2P {cluster.intra_bandwidth / 1e9:.2f} GB/s, "
                   f"all-reduce {cluster.inter_bandwidth / 1e9:.2f} GB/s, latency "
                   f"{cluster.intra_latency * 1e6:.0f} µs, engine overhead "
                   f"{cluster.op_overhead * 1e3:.2f} ms per op, Adam "
                   f"{cluster.memory_bandwidth / 1e9:.2f} GB/s")
    result = plan(model, cluster, BATCH, options=SearchOptions(
        schedules=BENCH_SCHEDULES, max_chunks=2, top=10_000))
    chosen = [p for p in result.predictions if p.config.num_microbatches in (2, 4, 8)
              and (not p.config.recomputes or (p.config.schedule, p.config.num_microbatches)
                   == ("1f1b", 8))]
    if result.best not in chosen:  # the planner's overall pick always runs
        chosen.insert(0, result.best)
    items = [{"config": p.config, "boundaries": p.boundaries} for p in chosen]
    ranks = launch(run_configs, 2, items, model_config, rounds, timeout=900.0,
                   threads_per_rank=1)
    measured = [max(rank[i]["seconds"] for rank in ranks) for i in range(len(chosen))]
    memory = [max(rank[i]["memory"] for rank in ranks) for i in range(len(chosen))]
    lines = [f"2 CPU ranks, demo LM (vocab 256, width 128, 6 blocks, seq 64), global batch "
             f"{BATCH}; {len(chosen)} configurations of {len(result.predictions)} feasible",
             calibration, "",
             "| configuration | predicted ms | measured ms | predicted MiB | measured MiB "
             "| memory error |", "|---|---:|---:|---:|---:|---:|"]
    errors = []
    for prediction, seconds, nbytes in zip(chosen, measured, memory):
        error = prediction.memory.total / nbytes - 1
        if not prediction.config.recomputes:
            errors.append(abs(error))
        note = " (recompute: checkpointed tensors unseen)" if prediction.config.recomputes else ""
        lines.append(f"| {prediction.config.label()} | {prediction.step_seconds * 1e3:.0f} | "
                     f"{seconds * 1e3:.0f} | {prediction.memory.total / MIB:.1f} | "
                     f"{nbytes / MIB:.1f} | {error:+.1%}{note} |")
    best_measured = min(measured)
    pick = chosen.index(result.best)
    pick_gap = measured[pick] / best_measured - 1
    rho = _spearman([p.step_seconds for p in chosen], measured)
    worst_memory = max(errors) if errors else float("nan")
    lines += ["", f"planner's pick {chosen[pick].config.label()}: measured {pick_gap:+.1%} "
                  f"from the best measured -> {_met(pick_gap <= 0.05)} (target <= 5%)",
              f"rank correlation predicted vs measured step time: {rho:.2f} -> "
              f"{_met(rho >= 0.9)} (target >= 0.9)",
              f"worst memory error (configurations without recomputation): "
              f"{worst_memory:.1%} -> {_met(worst_memory <= 0.10)} (target <= 10%)"]
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("search", "scale", "local", "emulated", "published",
                                           "all"),
                        default="all")
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8], choices=(2, 4, 8),
                        help="emulated device counts (--part emulated)")
    parser.add_argument("--rounds", type=int, default=8,
                        help="timed steps of every configuration (fastest kept)")
    args = parser.parse_args(argv)
    if args.part in ("search", "all"):
        wall, cpu, what = search_time()
        load = os.getloadavg()[0]
        print(f"search, {SEARCH_SHAPE} on 8 × 8 a100-80g, global batch 512: {what}; "
              f"{wall:.2f} s wall, {cpu:.2f} s CPU (load average {load:.1f} on "
              f"{os.cpu_count()} cores) -> {_met(wall < 10)} (target < 10 s wall)")
    if args.part in ("scale", "all"):
        print(scale_search())
    if args.part in ("published", "all"):
        from bench_published import published_part, sweeps_part
        from published_sensitivity import disagreement_part
        from table1_loo import loo_lines

        print("\n".join(published_part()))
        print("\n".join(["", *loo_lines()]))
        print("\n".join(["", *disagreement_part()]))
        print("\n".join(["", *sweeps_part()]))
    if args.part in ("local", "all"):
        print("\n".join(local_part(args.rounds)))
    if args.part in ("emulated", "all"):
        from plan_emulated import emulated_part

        for devices in args.devices:
            print("\n".join(emulated_part(devices, args.rounds)))


if __name__ == "__main__":
    main()
