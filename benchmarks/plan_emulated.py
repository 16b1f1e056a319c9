"""`bench_plan.py --part emulated`: the planner's predictions against runs on 4 and 8
emulated devices (ranks whose layers wait their planned F, I and W times).

The model is shaped like a small transformer (`EMULATED_SHAPE`: an embedding, 14 blocks and
a head) and priced per layer as a profile would measure it: a block's forward costs
`BLOCK_FORWARD` seconds per sample, the embedding's and head's in proportion to their FLOPs
(the standard formulas, `pipeline.planner.transformer`), the backward twice the forward, I
and W half each; every F, I and W also costs `FIXED` seconds per call whatever the batch
(a real layer's dispatch), so small microbatches shrink the bubble but pay more calls. The
first layer's input is data: it has no I. Parameters are scaled down to at most `MAX_PARAMS`
float32 per layer and hidden states to `HIDDEN_ELEMENTS` float32 per sample, so the
data-parallel all-reduce and Adam stay small on 2 real cores: the comparison is about
schedules, bubbles and the engine's per-op overhead. Each layer holds its output for the
backward (what an emulated layer can hold), so the planner's memory is checked too.

The cluster is this machine as `calibrate_local(ranks=p)` measures it (2 gloo ranks: P2P
latency and bandwidth, all-reduce bandwidth, the engine's fixed cost per op, Adam's memory
bandwidth), with p devices on one node. The search covers pp × dp (tp = 1: emulated layers
have no tensor-parallel split; no recomputation: emulated layers are not rehearsed with it),
ZeRO 0/1, the schedules 1f1b, gpipe, interleaved (v = 2), zb-h1 and zb-v, and every
microbatch count. The configurations run are those with m in `MICROBATCHES` times the
pipeline depth (plus the planner's pick, always). Each runs with the planner's partition and
`pipeline.rehearsal.planned`'s costs for its microbatch size: one warm-up step, one
metered step (memory), then one timed step of every configuration per round for `rounds`
rounds (barrier before and after each), the fastest kept (the median is printed too).
Every engine's failure watchdog is stopped once it is built: a hundred engines polling the
store ten times a second would load the cores the timed steps share.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.planner import (
    ClusterSpec,
    LayerProfile,
    ModelProfile,
    Prediction,
    SearchOptions,
    parse_shape,
    plan,
    transformer_profile,
)

if TYPE_CHECKING:
    from pipeline.rehearsal.rehearse import RehearsalSpec

__all__ = ["emulated_model", "emulated_part", "run_plans"]

MIB = 2**20
EMULATED_SHAPE = "layers=14,hidden=256,heads=8,vocab=4096,seq=128"
BLOCK_FORWARD = 0.2e-3
"""Seconds per sample of a block's forward."""
FIXED = 0.3e-3
"""Seconds per call of each layer's F, I and W."""
MAX_PARAMS = 16_384
"""float32 parameters of the largest layer."""
HIDDEN_ELEMENTS = 256
"""float32 elements per sample of a hidden state (1 KiB)."""
GLOBAL_BATCH = 32
SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v")
MICROBATCHES = (1, 2, 4)
"""Microbatch counts run, in multiples of the pipeline depth p (pp = 1: m = 1, 2, 4)."""


def emulated_model() -> ModelProfile:
    """The per-layer costs the emulated devices wait (see the module docstring)."""
    shape = parse_shape(EMULATED_SHAPE)
    base = transformer_profile(shape)
    block_flops = base.layers[1].flops_split + base.layers[1].flops_replicated
    hidden = base.layers[1].output_bytes
    param_scale = MAX_PARAMS / max(layer.params(1) for layer in base.layers)
    layers: list[LayerProfile] = []
    for index, layer in enumerate(base.layers):
        forward = BLOCK_FORWARD * (layer.flops_split + layer.flops_replicated) / block_flops
        output = 4 * max(1, round(layer.output_bytes / hidden * HIDDEN_ELEMENTS))
        input_grad = 0.0 if index == 0 else forward  # the first layer's input is data
        input_fixed = 0.0 if index == 0 else FIXED
        layers.append(LayerProfile(
            name=layer.name, params_replicated=max(1, round(layer.params(1) * param_scale)),
            held_replicated=output, output_bytes=output,
            input_bytes=layers[-1].output_bytes if layers else 0.0,
            forward_seconds=forward, backward_seconds=input_grad + forward,
            forward_fixed=FIXED, backward_fixed=input_fixed + FIXED,
            split_seconds=(input_grad, forward), split_fixed=(input_fixed, FIXED)))
    return ModelProfile(tuple(layers), name=f"emulated {base.name}", seq=shape.seq)


def run_plans(plans: list[RehearsalSpec], rounds: int) -> list[dict[str, Any]]:
    """On every rank: build every plan's engine (process groups shared per dp size), one
    warm-up and one metered step each, then `rounds` rounds of one timed step of each."""
    import torch
    import torch.distributed as dist

    from pipeline.parallel.groups import create_process_groups
    from pipeline.parallel.topology import Topology
    from pipeline.rehearsal.rehearse import build_engine, metered_step

    torch.set_num_threads(1)
    world = dist.get_world_size()
    groups: dict[int, Any] = {}
    runs: list[tuple[Any, Any, Any, list[float]]] = []
    for item in plans:
        if item.data_parallel > 1 and item.data_parallel not in groups:
            groups[item.data_parallel] = create_process_groups(
                Topology.for_world(world, dp=item.data_parallel))
        engine = build_engine(item, groups=groups.get(item.data_parallel))
        # dozens of engines' watchdogs polling the store 10 times a second would load the
        # cores the timed steps share; the launcher's watchdog still ends a failed job
        engine.stop_watchdog()
        inputs = torch.zeros(item.microbatches, 1)  # one row per microbatch
        engine.train_batch(inputs, inputs)  # warm-up: buffers, shapes
        memory = metered_step(engine, inputs)
        runs.append((engine, inputs, memory, []))
    for _ in range(rounds):
        for engine, inputs, _memory, times in runs:
            dist.barrier()
            start = time.perf_counter()
            engine.train_batch(inputs, inputs)
            dist.barrier()
            times.append(time.perf_counter() - start)
    return [{"fastest": min(times), "median": statistics.median(times),
             "memory": memory.total} for _engine, _inputs, memory, times in runs]


def _chosen(predictions: list[Prediction], best: Prediction) -> list[Prediction]:
    """The configurations run: m in `MICROBATCHES` × p, and the planner's pick."""
    chosen = [p for p in predictions
              if p.config.num_microbatches in {k * p.config.pp for k in MICROBATCHES}]
    if best not in chosen:
        chosen.insert(0, best)
    return chosen


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation, ties given their mean rank."""
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def emulated_part(devices: int, rounds: int, cluster: ClusterSpec | None = None
                  ) -> list[str]:
    """Plan the emulated model on `devices` emulated devices, run the chosen configurations
    on as many ranks, compare; the lines to print."""
    from dataclasses import replace

    from pipeline import launch
    from pipeline.planner.calibrate import calibrate_local
    from pipeline.rehearsal.planned import planned_rehearsal

    model = emulated_model()
    cluster = replace(cluster or calibrate_local(ranks=devices), devices_per_node=devices)
    started = time.perf_counter()
    result = plan(model, cluster, GLOBAL_BATCH, options=SearchOptions(
        schedules=SCHEDULES, max_chunks=2, recompute=False, tensor_parallel=(1,), top=10_000))
    chosen = _chosen(result.predictions, result.best)
    plans = [planned_rehearsal(p, model, cluster) for p in chosen]
    ranks = launch(run_plans, devices, plans, rounds, timeout=900.0, threads_per_rank=1)
    measured = [max(rank[i]["fastest"] for rank in ranks) for i in range(len(chosen))]
    medians = [max(rank[i]["median"] for rank in ranks) for i in range(len(chosen))]
    memory = [max(rank[i]["memory"] for rank in ranks) for i in range(len(chosen))]
    lines = [f"{devices} emulated devices, {model.name} (emulated costs), global batch "
             f"{GLOBAL_BATCH}: {len(chosen)} configurations run of {len(result.predictions)} "
             f"feasible; {time.perf_counter() - started:.0f} s",
             f"cluster {cluster.name!r}: P2P {cluster.intra_bandwidth / 1e9:.2f} GB/s, latency "
             f"{cluster.intra_latency * 1e6:.0f} µs, all-reduce "
             f"{cluster.inter_bandwidth / 1e9:.2f} GB/s, engine overhead "
             f"{cluster.op_overhead * 1e3:.2f} ms per op, Adam "
             f"{cluster.memory_bandwidth / 1e9:.2f} GB/s", "",
             "| configuration | predicted ms | measured ms (fastest) | measured ms (median) | "
             "measured ÷ predicted | predicted KiB | measured KiB | memory error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    errors = []
    for prediction, seconds, median, nbytes in zip(chosen, measured, medians, memory):
        error = prediction.memory.total / nbytes - 1
        errors.append(abs(error))
        mark = " (pick)" if prediction is result.best else ""
        lines.append(f"| {prediction.config.label()}{mark} | "
                     f"{prediction.step_seconds * 1e3:.1f} | {seconds * 1e3:.1f} | "
                     f"{median * 1e3:.1f} | {seconds / prediction.step_seconds:.2f} | "
                     f"{prediction.memory.total / 1024:.0f} | {nbytes / 1024:.0f} | "
                     f"{error:+.1%} |")
    pick = chosen.index(result.best)
    fastest = int(np.argmin(measured))
    pick_gap = measured[pick] / measured[fastest] - 1
    rho = _spearman([p.step_seconds for p in chosen], measured)
    lines += ["", f"planner's pick {chosen[pick].config.label()}: measured {pick_gap:+.1%} "
                  f"from the best measured ({chosen[fastest].config.label()}) -> "
                  f"{_met(pick_gap <= 0.05)} (target <= 5%)",
              f"rank correlation (Spearman) predicted vs measured step time: {rho:.2f} -> "
              f"{_met(rho >= 0.9)} (target >= 0.9)",
              f"worst memory error: {max(errors):.1%} -> {_met(max(errors) <= 0.10)} "
              f"(target <= 10%)"]
    return lines
