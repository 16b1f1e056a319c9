"""A rehearsal: the real engine on local ranks, with emulated compute built from a cost file.

The costs (the partitioner's JSON, e.g. profiled on a GPU cluster) become `EmulatedLayer`s:
each F, I and W waits its time, each output has its bytes (divided by `bytes_scale`), so the
run exercises the schedule, the P2P and the host work of the engine as the cluster would,
on a CPU. `rehearse_rank` runs on every rank; the spec is built and checked before launch.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from partition import ModelGraph
from pipeline.model.module import PipelineModule
from pipeline.parallel.data_parallel import DEFAULT_BUCKET_MB
from pipeline.parallel.groups import ProcessGroups
from pipeline.parallel.pingpong import ping_pong
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.rehearsal.emulated import EmulatedCost, emulated_layers, emulated_loss
from pipeline.runtime.engine import PipelineEngine
from pipeline.runtime.saved_memory import SavedTensorMeter
from schedules import CostModel, GradReduction, Schedule, Timeline, figures
from schedules.analysis.host import Link
from schedules.analysis.memory import MemoryModel, RankMemory

__all__ = [
    "GradientPeak",
    "RehearsalReport",
    "RehearsalSpec",
    "build_engine",
    "emulation_costs",
    "measured_memory",
    "metered_step",
    "reduction_seconds",
    "rehearse_rank",
]

BYTES = 4  # float32


def emulation_costs(graph: ModelGraph, *, weight_fraction: float = 0.5,
                    bytes_scale: float = 1.0, time_scale: float = 1.0) -> list[EmulatedCost]:
    """One `EmulatedCost` per layer of `graph`: its backward split into I and W by
    `weight_fraction` (the JSON gives B = I + W), times multiplied by `time_scale`, bytes
    divided by `bytes_scale` (at least one float32 element each).

    The first layer's input is data, so its I never runs: its input_grad is 0 here, and the
    simulator is given the same costs.
    """
    if not 0.0 <= weight_fraction <= 1.0:
        raise ValueError(f"weight_fraction must be in [0, 1] (the share of each layer's "
                         f"backward that is W), got {weight_fraction!r}")
    for name, value in (("bytes_scale", bytes_scale), ("time_scale", time_scale)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    costs = []
    for index, layer in enumerate(graph.layers):
        backward = layer.backward * time_scale
        costs.append(EmulatedCost(
            forward=layer.forward * time_scale,
            input_grad=0.0 if index == 0 else backward * (1.0 - weight_fraction),
            weight_grad=backward * weight_fraction,
            output_elements=_elements(layer.activation, bytes_scale, index, "activation"),
            param_elements=_elements(layer.params, bytes_scale, index, "params")))
    return costs


def _elements(nbytes: float, bytes_scale: float, index: int, what: str) -> int:
    """float32 elements standing for `nbytes` / `bytes_scale` (at least one)."""
    elements = nbytes / bytes_scale / BYTES
    if not elements <= 2**53:  # also inf and NaN: a tensor that size cannot exist
        raise ValueError(f"layer {index}'s {what} of {nbytes:g} bytes / bytes_scale "
                         f"{bytes_scale:g} is {elements:g} float32 elements, more than any "
                         "host holds; raise bytes_scale (--bytes-scale)")
    return max(1, round(elements))


@dataclass(frozen=True, kw_only=True)
class RehearsalSpec:
    """Everything a rank needs; made and checked by the CLI before any process starts."""

    layers: tuple[EmulatedCost, ...]
    boundaries: tuple[int, ...]
    """S + 1 cut indices into `layers` (S = stages × chunks)."""
    schedule: str
    stages: int
    chunks: int
    microbatches: int
    data_parallel: int = 1
    zero_stage: int = 0
    steps: int = 5
    """Timed steps; the one of median makespan is reported."""
    warmup: int = 1

    def stage_layers(self, stage: int) -> tuple[EmulatedCost, ...]:
        return self.layers[self.boundaries[stage]:self.boundaries[stage + 1]]

    @property
    def total_stages(self) -> int:
        return self.stages * self.chunks

    def cost_model(self) -> CostModel:
        """The nominal per-stage costs the emulated layers wait (no host work, free P2P)."""
        stages = [self.stage_layers(s) for s in range(self.total_stages)]
        return CostModel(
            forward=[sum(c.forward for c in layers) for layers in stages],
            backward=[sum(c.input_grad for c in layers) for layers in stages],
            weight=[sum(c.weight_grad for c in layers) for layers in stages],
            comm=0.0,
            activation_bytes=[layers[-1].output_elements * BYTES for layers in stages])

    def grad_reduction(self, seconds: Mapping[int, float]) -> GradReduction | None:
        """The engine's data-parallel reduction for the simulator (None when d = 1): stage
        s's whole reduction takes `seconds[s]` (measured: `reduction_seconds`), in buckets of
        the engine's default 25 MiB, overlapped as the engine does by default."""
        if self.data_parallel == 1:
            return None
        nbytes = [sum(c.param_elements for c in self.stage_layers(s)) * BYTES
                  for s in range(self.total_stages)]
        return GradReduction(
            time=[seconds.get(s, 0.0) for s in range(self.total_stages)],
            buckets=[max(1, math.ceil(n / (DEFAULT_BUCKET_MB * 2**20))) for n in nbytes])

    def memory_model(self) -> MemoryModel:
        """Parameter and saved-activation bytes per stage (one row per microbatch), Adam."""
        stages = [self.stage_layers(s) for s in range(self.total_stages)]
        return MemoryModel(
            params=[sum(c.param_elements for c in layers) * BYTES for layers in stages],
            saved=[sum(c.output_elements for c in layers) * BYTES for layers in stages],
            output=[layers[-1].output_elements * BYTES for layers in stages],
            data_parallel=self.data_parallel, zero_stage=self.zero_stage, optimizer_factor=2.0)


@dataclass(frozen=True)
class RehearsalReport:
    """What rank 0 brings back."""

    timeline: Timeline
    """Measured spans (s) of the step of median makespan, every pipeline rank."""
    step_seconds: list[float]
    link: Link
    """The ping-pong between pipeline ranks 0 and 1 before the run."""
    memory: list[RankMemory]
    """Measured bytes per pipeline rank (replica 0)."""
    reduction_seconds: dict[int, float] = field(default_factory=dict)
    """Per stage, one whole gradient reduction over the replicas, timed before the steps
    (`reduction_seconds`; empty when d = 1)."""
    exposed_reduction: list[float] = field(default_factory=list)
    """Seconds of the reported step each pipeline rank (replica 0) spent on the gradient
    reduction not hidden behind compute (`StepStats.exposed_reduction`)."""


def _unique_bytes(tensors: Sequence[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def build_engine(spec: RehearsalSpec, schedule: str | Schedule | None = None,
                 groups: ProcessGroups | None = None) -> PipelineEngine:
    """This rank's engine over emulated layers (Adam, the spec's dp and ZeRO stage); `groups`
    (made for the spec's topology) lets many engines share their process groups."""
    module = PipelineModule(emulated_layers(spec.layers), num_stages=spec.stages,
                            chunks=spec.chunks, loss_fn=emulated_loss,
                            partition_method=list(spec.boundaries), base_seed=None)
    return PipelineEngine(module, schedule=schedule or spec.schedule,
                          num_microbatches=spec.microbatches,
                          optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
                          data_parallel=spec.data_parallel, zero_stage=spec.zero_stage,
                          groups=groups)


class GradientPeak:
    """The most gradient bytes this rank's parameters hold at once (each storage once),
    read whenever a gradient is accumulated."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.peak = 0
        self._hooks = [param.register_post_accumulate_grad_hook(self._seen)
                       for param in self.params]

    def remove(self) -> None:
        """Stop watching (the hooks cost host time at every gradient)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _seen(self, _: torch.Tensor) -> None:
        held = _unique_bytes([p.grad for p in self.params if p.grad is not None])
        self.peak = max(self.peak, held)


def measured_memory(engine: PipelineEngine, activation_peak: int,
                    gradient_peak: int) -> RankMemory:
    """This rank's bytes after a step: parameters, gradients (the parameters' own at their
    peak, and ZeRO-1's reduce buffers), optimizer state (with ZeRO-1's master shard), and
    the saved-activation peak a `SavedTensorMeter` saw."""
    params = list(engine.module.parameters())
    stats = engine.last_stats
    optimizer = engine.optimizer
    buffers = master = 0
    if isinstance(optimizer, ShardedOptimizer):
        buffers, master = optimizer.gradient_buffer_bytes(), optimizer.master_bytes()
    return RankMemory(
        rank=engine.pp_rank, params=float(_unique_bytes(params)),
        gradients=float(gradient_peak + buffers),
        optimizer=float(engine.optimizer_state_bytes() + master),
        activations=float(activation_peak),
        peak_in_flight=stats.peak_activations if stats else 0)


def metered_step(engine: PipelineEngine, inputs: torch.Tensor) -> RankMemory:
    """One step with saved-tensor and gradient meters on (untimed: their hooks cost host
    time at every saved tensor and gradient); this rank's measured memory."""
    meter = SavedTensorMeter(ignore=list(engine.module.parameters()))
    gradients = GradientPeak(list(engine.module.parameters()))
    try:
        with meter:
            engine.train_batch(inputs, inputs)
    finally:
        gradients.remove()
    return measured_memory(engine, meter.peak, gradients.peak)


def reduction_seconds(engine: PipelineEngine, spec: RehearsalSpec, repeats: int = 3
                      ) -> dict[int, float]:
    """Per stage of this rank: seconds of one whole reduction of its fp32 gradients over the
    data-parallel group, with the collective the engine issues on gloo (all-reduce; ZeRO-1:
    all_to_all of the shards), the median of `repeats` (collective over the dp group)."""
    if spec.data_parallel == 1 or engine.groups is None:
        return {}
    group, d = engine.groups.dp_group, spec.data_parallel
    seconds = {}
    for stage in engine.schedule.stages_of(engine.pp_rank):
        elements = sum(c.param_elements for c in spec.stage_layers(stage))
        flat = torch.zeros(math.ceil(elements / d) * d)
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            start = time.perf_counter()
            if spec.zero_stage:
                dist.all_to_all_single(torch.empty_like(flat), flat, group=group)
            else:
                dist.all_reduce(flat, group=group)
            times.append(time.perf_counter() - start)
        seconds[stage] = statistics.median(times)
    return seconds


def rehearse_rank(spec: RehearsalSpec) -> RehearsalReport | None:
    """Run the spec on this rank; the report on global rank 0, None elsewhere."""
    torch.set_num_threads(1)
    engine = build_engine(spec)
    biggest = max(c.output_elements for c in spec.layers) * BYTES
    link = Link(0.0)
    if spec.stages > 1:  # replica 0's first link, measured before any step
        link = ping_pong(engine.topology.rank_of(0), engine.topology.rank_of(1), biggest,
                         link=engine.comm.local)
    inputs = torch.zeros(spec.microbatches, 1)
    mine = metered_step(engine, inputs)  # memory on its own step: the meters cost time
    reduce = reduction_seconds(engine, spec)
    timelines: list[Timeline] = []
    seconds: list[float] = []
    exposed: list[float] = []
    for step in range(spec.warmup + spec.steps):
        dist.barrier()
        start = time.perf_counter()
        engine.train_batch(inputs, inputs)
        elapsed = time.perf_counter() - start
        timeline = engine.last_timeline()  # a collective: every rank calls it
        if step >= spec.warmup:
            seconds.append(elapsed)
            timelines.append(timeline)
            stats = engine.last_stats
            exposed.append(stats.exposed_reduction if stats is not None else 0.0)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (engine.position.dp_rank, mine, exposed, reduce))
    if dist.get_rank() != 0:
        return None
    replica = sorted(((m, e) for dp_rank, m, e, _ in gathered if dp_rank == 0),
                     key=lambda item: item[0].rank)
    stage_seconds = {s: t for dp_rank, _, _, r in gathered if dp_rank == 0
                     for s, t in r.items()}
    makespans = [figures(t).makespan for t in timelines]
    middle = makespans.index(statistics.median_low(makespans))
    return RehearsalReport(timelines[middle], seconds, link, [m for m, _ in replica],
                           stage_seconds, [e[middle] for _, e in replica])
