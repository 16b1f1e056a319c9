"""The search: every pp × tp × dp × ZeRO × schedule × chunks × microbatching × recompute,
pruned by memory first, then by a lower bound on the step, the survivors simulated."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from pipeline.planner.bounds import SearchBounds
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.diagnose import SearchLog, nothing_fits
from pipeline.planner.errors import PlanError
from pipeline.planner.grid import configurations, engine_refuses
from pipeline.planner.memory import MemoryBreakdown
from pipeline.planner.options import (
    RECOMPUTE_CHOICES,
    TRAINING_SCHEDULES,
    UNPRICED,
    SearchOptions,
)
from pipeline.planner.predict import PlanConfig, PlanContext, Prediction, is_cost_aware
from pipeline.planner.profile import ModelProfile
from pipeline.planner.request_check import check_request
from pipeline.planner.split_cause import split_message, uneven_fit
from pipeline.planner.stages import block_span
from pipeline.planner.step import Beaten
from schedules.ir.schedule import gc_paused

__all__ = ["RECOMPUTE_CHOICES", "PlanResult", "SearchOptions", "check_request", "format_counts",
           "plan", "price"]

GIB = 2**30


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
    stopped_early: int = 0
    """Fits in memory, and its simulation stopped once its step was proven beaten as
    `skipped_by_bound` says (K simulated ones faster, one of them no larger)."""
    seconds: float = 0.0
    """The search's CPU time (this process's, `time.process_time`): what the search costs,
    whatever else the host runs (a loaded host once printed 96.8 s of wall time for 2.6 s)."""
    wall_seconds: float = 0.0
    """The search's wall-clock time."""
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



@gc_paused  # millions of small tuples and arrays, no cycles: collections find nothing
def plan(model: ModelProfile, cluster: ClusterSpec, global_batch: int, *,
         precision: str | None = None, options: SearchOptions | None = None) -> PlanResult:
    """Search every configuration of `model` on `cluster` for `global_batch` samples a step.

    Raises `PlanError` when nothing fits, naming the leanest configuration's need."""
    started, started_cpu = time.perf_counter(), time.process_time()
    options = options or SearchOptions()
    check_request(model, cluster, global_batch, options)
    context = _context(model, cluster, global_batch, precision, options)
    cluster.flops(context.precision)  # refuses an unknown precision up front
    bounds = SearchBounds(context)
    result = PlanResult([])
    fitting: list[tuple[float, PlanConfig, float]] = []
    leanest: tuple[float, PlanConfig | None] = (float("inf"), None)
    log = SearchLog()
    # Step 1: memory first. Every rank holds at least one microbatch's activations of each
    # of its stages at once (`PlanContext.memory`), a floor that prunes before any schedule
    # is made.
    for config in configurations(model, cluster, global_batch, options, log):
        result.considered += 1
        floor = bounds.memory_floor(config)
        if floor < leanest[0]:
            leanest = (floor, config)
        if options.prune and floor > cluster.device_memory:
            result.over_memory += 1
            continue
        fitting.append((bounds.lower_bound(config), config, floor))
    if leanest[1] is not None:
        result.leanest = (leanest[1], context.memory(leanest[1], floor=True)[0])
    # Step 2: cheapest time bound first. A configuration that K simulated ones beat in time
    # (its bound), one of them also in memory (its floor), can reach neither the top K nor
    # the Pareto front: strictly faster, so no tie is broken differently. The others get
    # their schedule's exact peak memory, then the simulator (whose runs configurations
    # that differ only in ZeRO share), which stops once the step is proven beaten the same
    # way (`_beaten_above`).
    fitting.sort(key=lambda item: (item[0], item[1]))
    times, sizes = np.empty(len(fitting)), np.empty(len(fitting))
    count = 0
    for bound, config, floor in fitting:
        faster = times[:count] < bound
        enough = options.prune and int(faster.sum()) >= options.top
        if enough and bool((sizes[:count][faster] <= floor).any()):
            result.skipped_by_bound += 1
            continue
        trace = context.held_trace(config)
        if trace is None and not is_cost_aware(config.schedule):
            result.refused_by_schedule += 1
            log.refused = log.refused or config
            continue
        memory = context.memory(config, trace)
        if memory[0].total > cluster.device_memory:
            result.over_memory += 1
            log.note_over(config, memory[0])
            continue
        if enough and bool((sizes[:count][faster] <= memory[0].total).any()):
            result.skipped_by_bound += 1
            continue
        prediction = context.predict(config, memory, beaten_above=_beaten_above(
            times[:count], sizes[:count], memory[0].total, options))
        if prediction is None:
            result.refused_by_schedule += 1
            log.refused = log.refused or config
            continue
        if isinstance(prediction, Beaten):
            result.stopped_early += 1
            continue
        result.predictions.append(prediction)
        times[count], sizes[count] = prediction.step_seconds, prediction.memory.total
        count += 1
    if not result.predictions:
        first, end = block_span(model.layers)
        _refuse_for_split(model, cluster, global_batch, precision, options, result, log,
                          end - first)
        raise nothing_fits(log, result.considered, result.leanest, cluster, global_batch,
                           model, options, end - first)
    result.predictions.sort(key=lambda p: (p.step_seconds, p.memory.total, p.config))
    result.seconds = time.process_time() - started_cpu
    result.wall_seconds = time.perf_counter() - started
    return result


def _refuse_for_split(model: ModelProfile, cluster: ClusterSpec, global_batch: int,
                      precision: str | None, options: SearchOptions, result: PlanResult,
                      log: SearchLog, blocks: int) -> None:
    """Raise the refusal that names the engine's even layer split when it, not the model's
    size, is why nothing fits: the leanest configuration the engine runs is over memory,
    and one the split alone refused fits (`split_cause.uneven_fit`)."""
    if result.leanest is None or not log.excluded["uniform"] \
            or result.leanest[1].total <= cluster.device_memory:
        return
    uneven = uneven_fit(model, cluster, global_batch, options,
                        lambda free: _context(model, cluster, global_batch, precision, free))
    if uneven is not None and uneven[1] <= cluster.device_memory:
        leanest = (result.leanest[0], result.leanest[1].total)
        raise PlanError(split_message(model, cluster, leanest, uneven, blocks, log.grid))


def _beaten_above(times: np.ndarray, sizes: np.ndarray, memory: float,
                  options: SearchOptions) -> float:
    """T*: a configuration of `memory` bytes whose step is longer is beaten by the simulated
    ones (`times`, `sizes`) as the bound's rule has it: K of them are strictly faster, one
    of those no larger. T* = max(t_K, t_M), t_K the K-th smallest time, t_M the smallest
    time of those no larger (inf without K of them, without one no larger, or unpruned).

    Leaving such a configuration out (`PlanResult.stopped_early`) keeps the top K and the
    Pareto front: K are ahead of it, and one is ahead in time at no more memory, so it is on
    neither; and it is never needed as a witness for skipping a later configuration, since
    whatever it beats, its own K faster ones (one of them no larger) beat too."""
    if not options.prune or len(times) < options.top:
        return math.inf
    smaller = times[sizes <= memory]
    if not len(smaller):
        return math.inf
    kth = float(np.partition(times, options.top - 1)[options.top - 1])
    return max(kth, float(smaller.min()))


def _context(model: ModelProfile, cluster: ClusterSpec, global_batch: int,
             precision: str | None, options: SearchOptions) -> PlanContext:
    """The pricing context of a search (or of one priced configuration) under `options`."""
    return PlanContext(model, cluster, global_batch, precision or cluster.precision,
                       overlap_grad_reduce=options.overlap_grad_reduce,
                       step_gradient_bytes=options.step_gradient_bytes,
                       update_bytes=options.update_bytes,
                       overlap_grad_reduce_unpipelined=options.overlap_grad_reduce_unpipelined,
                       uniform_layers=options.uniform_layers, blocking_p2p=options.blocking_p2p,
                       grad_reduce_bytes=options.grad_reduce_bytes,
                       overlap_param_gather=options.overlap_param_gather,
                       tied_reduce_at_step=options.tied_reduce_at_step,
                       tp_overlap=options.tp_overlap, state_bytes=options.state_bytes,
                       two_batch_overlap=options.two_batch_overlap,
                       expert_tensor_parallel=options.expert_tensor_parallel,
                       moe_dispatcher=options.moe_dispatcher,
                       routing_imbalance=options.routing_imbalance,
                       p2p_overlap_interleaved=options.p2p_overlap_interleaved,
                       p2p_gather=options.p2p_gather,
                       expert_grad_group=options.expert_grad_group,
                       cp_attention=options.cp_attention)


def price(model: ModelProfile, cluster: ClusterSpec, global_batch: int, config: PlanConfig,
          *, precision: str | None = None, overlap_grad_reduce: bool = True,
          options: SearchOptions | None = None) -> Prediction:
    """One named configuration priced as the search prices it (its schedule's peak memory,
    the simulated step), whether or not it fits in memory: the caller compares
    `memory.total` with the device's. `options` gives the engine the search would model
    (its pricing fields and its rules, e.g. Megatron-LM's uniform split); without them,
    this engine with `overlap_grad_reduce`."""
    if options is None:
        options = SearchOptions(overlap_grad_reduce=overlap_grad_reduce)
    check_request(model, cluster, global_batch, replace(
        options, tensor_parallel=(config.tp,), pipeline_parallel=(config.pp,),
        data_parallel=(config.dp,), expert_parallel=(config.ep,),
        context_parallel=(config.cp,)))
    used = config.pp * config.tp * config.dp * config.cp
    if used != cluster.num_devices:
        raise PlanError(f"{config.label()} uses {used} devices; the cluster has "
                        f"{cluster.num_devices} (pp · tp · dp · cp must equal it)")
    if config.dp * config.microbatch_size * config.num_microbatches != global_batch:
        raise PlanError(f"{config.label()}: dp · b · m = "
                        f"{config.dp * config.microbatch_size * config.num_microbatches}, not "
                        f"the global batch {global_batch}")
    if config.pp * config.chunks > len(model.layers):
        raise PlanError(f"{config.label()}: {config.pp * config.chunks} stages need as many "
                        f"layers; {model.name} has {len(model.layers)}")
    first, end = block_span(model.layers)
    rule = engine_refuses(options, end - first, config.pp, config.schedule, config.chunks,
                          config.num_microbatches)
    if rule:
        raise PlanError(f"{config.label()}: the engine these options model cannot run it ("
                        + (f"it splits the blocks evenly: p·v = {config.pp * config.chunks} "
                           f"must divide the {end - first} blocks" if rule == "uniform" else
                           f"it interleaves only at p >= {options.interleaved_min_pp} with m a "
                           f"multiple of p: p "
                           f"{config.pp}, m {config.num_microbatches}") + ")")
    refused = _outside_options(options, config)
    if refused:
        raise PlanError(f"{config.label()}: the engine these options model cannot run it "
                        f"({refused})")
    context = _context(model, cluster, global_batch, precision, options)
    cluster.flops(context.precision)
    trace = context.held_trace(config)
    if trace is None and not is_cost_aware(config.schedule):
        raise PlanError(f"schedule {config.schedule} refuses {config.label()} (pp "
                        f"{config.pp}, m {config.num_microbatches}, v {config.chunks})")
    prediction = context.predict(config, context.memory(config, trace))
    if not isinstance(prediction, Prediction):  # None: refused (no limit: never Beaten)
        raise PlanError(f"schedule {config.schedule} refuses {config.label()}")
    return prediction


def _outside_options(options: SearchOptions, config: PlanConfig) -> str:
    """What of `config` the options' engine does not run ("" if nothing): its schedule, ZeRO
    stage or recomputation mode. Where every training schedule is allowed, the unsearched
    ones may still be priced by name."""
    schedules = options.schedules
    if set(TRAINING_SCHEDULES) <= set(schedules):
        schedules = schedules + UNPRICED
    mode = "partial" if config.recompute == "full" and config.recompute_layers else \
        config.recompute
    if config.schedule not in schedules:
        return f"schedule {config.schedule}; it runs {', '.join(schedules)}"
    if options.zero_stages is not None and config.zero_stage not in options.zero_stages:
        return (f"ZeRO stage {config.zero_stage}; it runs "
                f"{', '.join(map(str, options.zero_stages))}")
    if mode not in options.recompute_modes():
        return f"recompute {mode}; it runs {', '.join(options.recompute_modes())}"
    return ""


def format_counts(result: PlanResult) -> str:
    """One line: how many configurations were considered and why the rest were dropped."""
    return (f"{result.considered} configurations: {len(result.predictions)} simulated, "
            f"{result.over_memory} over memory, {result.refused_by_schedule} refused by their "
            f"schedule, {result.skipped_by_bound} beaten by a bound, {result.stopped_early} "
            f"beaten during their simulation; {result.seconds:.2f} s of CPU "
            f"({result.wall_seconds:.2f} s wall)")
