"""The search: every pp × tp × dp × ZeRO × schedule × chunks × microbatching × recompute,
pruned by memory first, then by a lower bound on the step, the survivors simulated."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.errors import PlanError
from pipeline.planner.memory import MemoryBreakdown
from pipeline.planner.predict import PlanConfig, PlanContext, Prediction, is_cost_aware
from pipeline.planner.profile import ModelProfile
from schedules import SCHEDULES
from schedules.ir.schedule import gc_paused

__all__ = ["PlanResult", "SearchOptions", "format_counts", "plan"]

GIB = 2**30
_UNPRICED = ("forward-only", "zb-optimal")
"""Not searched. forward-only trains nothing. zb-optimal proves its order with a solver
(up to 10 s per configuration, thousands of configurations a search): the searched
zero-bubble family (zb-auto, zb-v-auto, interleaved-zb) stands for it."""
_TRAINING_SCHEDULES = tuple(name for name in SCHEDULES if name not in _UNPRICED)


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What the search may vary besides the grid."""

    schedules: tuple[str, ...] = _TRAINING_SCHEDULES
    max_chunks: int = 4
    """Largest v tried for schedules with a free chunk count (interleaved, looped-bfs)."""
    recompute: bool = True
    """Also try full activation recomputation."""
    tensor_parallel: tuple[int, ...] | None = None
    """tp sizes to try; None: every divisor of the devices per node that divides the heads."""
    top: int = 10
    """Configurations kept exactly ranked (the bound never skips one of them)."""
    zb_auto_max: int = 1024
    """zb-auto (a greedy search per configuration, ~p²·m work) only where p·m is at most
    this; larger pipelines get the fixed zero-bubble schedules (zb-h1, zb-h2, zb-v)."""
    searched_max: int = 32
    """zb-v-auto and interleaved-zb (searches of several orders per configuration, 3-6×
    zb-auto's time: 0.2 s at p·m = 128, 0.6 s at 512 here) only where p·m is at most this:
    the 64-device search takes 6 s at 32, 9 s at 64, 15 s at 128."""

    def __post_init__(self) -> None:
        unknown = [name for name in self.schedules if name not in _TRAINING_SCHEDULES]
        if unknown or not self.schedules:
            raise PlanError(f"schedules {unknown or '(none)'} are not training schedules; "
                            f"choose from {', '.join(_TRAINING_SCHEDULES)}")
        for name in ("max_chunks", "top", "zb_auto_max", "searched_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name}={value!r} must be a whole number >= 1")


@dataclass
class PlanResult:
    """Feasible configurations, fastest first, and what the search discarded."""

    predictions: list[Prediction]
    considered: int = 0
    over_memory: int = 0
    refused_by_schedule: int = 0
    skipped_by_bound: int = 0
    """Fits in memory, but a simulated configuration is both faster than its lower bound and
    no larger: it can be neither in the top K nor on the Pareto front."""
    seconds: float = 0.0
    leanest: tuple[PlanConfig, MemoryBreakdown] | None = field(default=None, repr=False)
    """The configuration with the smallest memory floor (one microbatch held per rank), for
    the "what would fit" message."""

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    def pareto(self) -> list[Prediction]:
        """Predictions no other beats in both step time and memory."""
        front, smallest = [], float("inf")
        for prediction in sorted(self.predictions,
                                 key=lambda p: (p.step_seconds, p.memory.total)):
            if prediction.memory.total < smallest:
                front.append(prediction)
                smallest = prediction.memory.total
        return front


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _chunk_options(name: str, pp: int, num_layers: int, max_chunks: int) -> list[int]:
    """Chunks per rank to try: 2..max_chunks for the looping schedules (v = 1 is 1F1B or
    GPipe again), the schedule's fixed count otherwise; p·v stages need p·v layers."""
    low, high = SCHEDULES[name].chunks
    if high is None:
        return list(range(max(low, 2), min(max_chunks, num_layers // pp) + 1))
    return [low] if low * pp <= num_layers else []


def _configs(model: ModelProfile, cluster: ClusterSpec, global_batch: int,
             options: SearchOptions) -> Iterator[PlanConfig]:
    devices, n = cluster.num_devices, len(model.layers)
    if options.tensor_parallel is not None:
        tps = list(options.tensor_parallel)
    elif model.tensor_parallel_ok and model.heads is not None:
        tps = [t for t in _divisors(cluster.devices_per_node) if model.heads % t == 0]
    else:
        tps = [1]
    for tp in tps:
        if devices % tp:
            continue
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            if pp > n or global_batch % dp:
                continue
            names = ("1f1b",) if pp == 1 else options.schedules
            for name in names:
                for chunks in _chunk_options(name, pp, n, options.max_chunks):
                    for b in _divisors(global_batch // dp):
                        m = global_batch // dp // b
                        if is_cost_aware(name) and pp * m > (
                                options.zb_auto_max if name == "zb-auto"
                                else options.searched_max):
                            continue
                        for zero in ((0, 1) if dp > 1 else (0,)):
                            for recompute in ((False, True) if options.recompute else (False,)):
                                yield PlanConfig(pp=pp, tp=tp, dp=dp, schedule=name,
                                                 chunks=chunks, microbatch_size=b,
                                                 num_microbatches=m,
                                                 zero_stage=zero, recompute=recompute)


@gc_paused  # millions of small tuples and arrays, no cycles: collections find nothing
def plan(model: ModelProfile, cluster: ClusterSpec, global_batch: int, *,
         precision: str | None = None, options: SearchOptions | None = None) -> PlanResult:
    """Search every configuration of `model` on `cluster` for `global_batch` samples a step.

    Raises `PlanError` when nothing fits, naming the leanest configuration's need."""
    started = time.perf_counter()
    options = options or SearchOptions()
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global batch {global_batch!r} must be a whole number >= 1")
    tp_sizes = options.tensor_parallel or ()
    if any(size > 1 for size in tp_sizes) and not model.tensor_parallel_ok:
        raise PlanError(f"tensor_parallel {list(tp_sizes)}: {model.name} has measured or "
                        f"cost-file layers, which cannot be split over tensor-parallel ranks; "
                        f"give a transformer shape, or tensor_parallel 1")
    context = PlanContext(model, cluster, global_batch, precision or cluster.precision)
    cluster.flops(context.precision)  # refuses an unknown precision up front
    result = PlanResult([])
    fitting: list[tuple[float, PlanConfig, MemoryBreakdown]] = []
    # Step 1: memory first. Every rank holds at least one microbatch's activations, so the
    # memory with one held per rank is a floor that prunes before any schedule is made.
    for config in _configs(model, cluster, global_batch, options):
        result.considered += 1
        floor = context.memory(config, floor=True)[0]
        if result.leanest is None or floor.total < result.leanest[1].total:
            result.leanest = (config, floor)
        if floor.total > cluster.device_memory:
            result.over_memory += 1
            continue
        fitting.append((context.lower_bound(config), config, floor))
    # Step 2: cheapest time bound first. A configuration that a simulated one beats in both
    # time (its bound) and memory (its floor) cannot reach the top K or the Pareto front;
    # the others get their schedule's exact peak memory, then the simulator.
    fitting.sort(key=lambda item: (item[0], item[1]))
    times, sizes = np.empty(len(fitting)), np.empty(len(fitting))
    count = 0
    for bound, config, floor in fitting:
        faster = times[:count] <= bound
        enough = int(faster.sum()) >= options.top
        if enough and bool((sizes[:count][faster] <= floor.total).any()):
            result.skipped_by_bound += 1
            continue
        trace = context.held_trace(config)
        if trace is None and not is_cost_aware(config.schedule):
            result.refused_by_schedule += 1
            continue
        memory = context.memory(config, trace)
        if memory[0].total > cluster.device_memory:
            result.over_memory += 1
            continue
        if enough and bool((sizes[:count][faster] <= memory[0].total).any()):
            result.skipped_by_bound += 1
            continue
        prediction = context.predict(config, memory)
        if prediction is None:
            result.refused_by_schedule += 1
            continue
        result.predictions.append(prediction)
        times[count], sizes[count] = prediction.step_seconds, prediction.memory.total
        count += 1
    if not result.predictions:
        raise _nothing_fits(result, cluster, global_batch, model)
    result.predictions.sort(key=lambda p: (p.step_seconds, p.memory.total, p.config))
    result.seconds = time.perf_counter() - started
    return result


def _nothing_fits(result: PlanResult, cluster: ClusterSpec, global_batch: int,
                  model: ModelProfile) -> PlanError:
    if result.leanest is None:
        return PlanError(
            f"no configuration of {cluster.num_devices} devices splits a global batch of "
            f"{global_batch} (data-parallel sizes must divide it) into schedules that accept "
            f"it; use a global batch divisible by {cluster.num_devices}")
    config, memory = result.leanest
    return PlanError(
        f"{model.name} does not fit on {cluster.num_devices} × "
        f"{cluster.device_memory / GIB:.1f} GiB devices: the leanest configuration "
        f"({config.label()}) needs at least {memory.total / GIB:.1f} GiB per device; use devices "
        f"with at least that much, more devices (--nodes), or a smaller model")


def format_counts(result: PlanResult) -> str:
    """One line: how many configurations were considered and why the rest were dropped."""
    return (f"{result.considered} configurations: {len(result.predictions)} simulated, "
            f"{result.over_memory} over memory, {result.refused_by_schedule} refused by their "
            f"schedule, {result.skipped_by_bound} beaten by a bound; {result.seconds:.2f} s")

