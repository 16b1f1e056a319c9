"""Price one configuration: partition, memory at the schedule's peak, and the simulated step
with tensor-parallel, pipeline and data-parallel communication and the optimizer step."""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import pipeline.planner.data_parallel as data_parallel
from partition import ModelGraph
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.config import PlanConfig
from pipeline.planner.expert_parallel import (
    expert_all_to_all,
    exposed_all_to_all,
    exposed_in_ops,
)
from pipeline.planner.memory import GRAD_BYTES, HeldTrace, MemoryBreakdown
from pipeline.planner.p2p import blocking_p2p
from pipeline.planner.peaks import PeakCounts, closed_form_peaks, same_trace_as
from pipeline.planner.pricing import p2p_link
from pipeline.planner.profile import LayerProfile, ModelProfile
from pipeline.planner.rank_pricing import (
    RankPricing,
    is_cost_aware,
    memory_limit,
    placement_of,
    schedule_placement,
)
from pipeline.planner.stages import LayerPrices, StageTable
from pipeline.planner.step import Beaten, compute_limits, step_breakdown, step_parts
from pipeline.planner.tied import stage_params
from schedules import (
    ComputeRuns,
    CostModel,
    Kind,
    Schedule,
    generate_schedule,
    simulate,
)
from schedules.analysis.simulate import simulate_unless_over

__all__ = ["PlanConfig", "PlanContext", "Prediction", "is_cost_aware", "memory_limit",
           "schedule_placement"]

_KEPT_SCHEDULES = 8
_KEPT_OPS = 1_000_000
"""Instructions of the schedules a search keeps beyond the last `_KEPT_SCHEDULES`."""


@dataclass(frozen=True)
class Prediction:
    """What the planner expects of one configuration."""

    config: PlanConfig
    step_seconds: float
    tokens_per_second: float
    flops_per_device: float
    """Model FLOP/s per device (3 × forward FLOPs per step; recomputation is not counted)."""
    memory: MemoryBreakdown
    """The rank holding the most."""
    memory_rank: int
    breakdown: dict[str, float]
    """Seconds of the step by cause on the rank that finishes last: compute, recomputation,
    tp_comm, cp_comm (context parallelism's K/V collectives, only where cp > 1), ep_comm
    (the expert all-to-all, exposed), bubble (idle and P2P waits; with
    `blocking_p2p` the messages), dp_comm
    (exposed), tied_comm (`tied.py`, waits included), optimizer. They sum to `step_seconds`."""
    boundaries: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"config": vars(self.config) | {"label": self.config.label()},
                "step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
                "flops_per_device": self.flops_per_device, "memory": self.memory.to_dict(),
                "memory_rank": self.memory_rank, "breakdown": self.breakdown,
                "boundaries": list(self.boundaries)}


@dataclass
class PlanContext(RankPricing):
    """The fixed inputs of a search and the caches its configurations share."""

    model: ModelProfile
    cluster: ClusterSpec
    global_batch: int
    precision: str
    step_gradient_bytes: float = 0.0
    """Bytes per parameter an engine holds at its optimizer step only, when no activation is
    left, counted with the gradients: Megatron-LM 2021 makes fp32 copies of its fp16
    gradients there (`_copy_model_grads_to_main_grads`: `main_param.grad =
    model_param.grad.float()`), 4."""
    update_bytes: float = data_parallel.ADAM_UPDATE_BYTES
    """Memory traffic of the optimizer step per parameter (`data_parallel.update_seconds`)."""
    overlap_grad_reduce: bool = True
    """The data-parallel reduction overlaps the last backward (the engine's gradient hooks,
    Megatron-Core's overlap_grad_reduce); False: it starts once the rank's pipeline has
    drained, as Megatron-LM did in 2021 (Narayanan et al.: all-reduce after the flush)."""
    expert_tensor_parallel: bool = False
    """Each MoE expert split over the tp group too (expert tensor parallelism = tp, the
    engine's `expert_tensor_parallel`; `RankPricing.expert_tp`); False: whole on its ep
    rank."""
    two_batch_overlap: bool = False
    """Forwards outside F&B pairs of an MoE stage run as two halves of the microbatch
    (the engine's `two_batch_overlap`, `ExpertAllToAll.two_batch`) where it has two samples
    or more."""
    moe_dispatcher: str = "alltoall"
    """How tokens reach their experts: one copy per (token, expert) pair, or one per node
    (deepep), the all-to-all's cross-node bytes (`node_limited.off_node_scale`)."""
    overlap_grad_reduce_unpipelined: bool = False
    """With `overlap_grad_reduce` False, still overlap the reduction where pp = 1: Megatron-LM
    2021 ran torch's DistributedDataParallel without a pipeline (its hooks reduce buckets
    during the last microbatch's backward) and its own reduction after the flush with one
    (the SC'21 scripts: `--DDP-impl torch` at p = 1, `local` above)."""
    uniform_layers: bool = False
    """Stages split as Megatron-LM splits them (`stages.uniform_boundaries`: the blocks
    evenly, the embedding on the first stage, the head and loss on the last) instead of by
    the exact partitioner's balance of their costs."""
    blocking_p2p: bool = False
    """Point-to-point messages hold both ranks: each F (B) that sends its output (input
    gradient) to another rank lasts until the message is through, and the receiver's op
    first all-gathers the 1/t pieces over NVLink. Megatron-LM 2021 waits on every
    `batch_isend_irecv` and then calls `torch.cuda.synchronize()` (`p2p_communication.py`);
    False: messages overlap compute, only delaying their receiver."""
    grad_reduce_bytes: float = GRAD_BYTES
    """Bytes per gradient element in the data-parallel reduction: 4 (fp32, this engine's
    gradients); 2 for Megatron-LM 2021's fp16 runs, which all-reduce the fp16 gradients
    (its default, without --accumulate-allreduce-grads-in-fp32)."""
    overlap_param_gather: bool = False
    """ZeRO-1's parameter all-gather left in flight after the step, each layer's next forward
    waiting for its own buckets (the engine's `overlap_param_gather`, off by default as
    there): priced by the simulator (`data_parallel.param_gather`); False: exposed after it."""
    tied_reduce_at_step: bool = True
    """Tied weights reduced over dp at STEP (this engine, `tied.py`); False: with the rest."""
    tp_overlap: str = "none"
    """How the engine hides tensor-parallel collectives behind GEMMs
    (`pricing.layer_tp_pass_seconds`: none, megatron-core)."""
    state_bytes: tuple[float, float, float] | None = None
    """Another engine's (parameter, gradient, optimizer) bytes per parameter
    (`memory.peak_rank_memory`); None: this engine's fp32 16 (8 + 8/dp under ZeRO-1)."""
    p2p_overlap_interleaved: bool = False
    """With `blocking_p2p`, the interleaved schedule's messages still overlap compute
    (Megatron-Core's --overlap-p2p-communication, its default)."""
    p2p_gather: bool = True
    """With `blocking_p2p`, the receiver all-gathers the t pieces over NVLink (Megatron-LM
    2021's scatter/gather); False: each tp rank sends its own part, nothing to gather."""
    routing_imbalance: float | None = None
    """The busiest ep rank's routed rows over the mean, as measured
    (`moe_shape.RoutedExperts.imbalance`); None: a balanced router's sampling floor
    (`routing_load.busiest_rank_ratio`)."""
    expert_grad_group: str = "tp_rank"
    """How the MoE gradients are summed at tp > 1 and whose group reduces and shards the
    experts (`expert_grad_sync`): this engine's "tp_rank", Megatron-Core's "megatron"."""
    cp_attention: str = "all-gather"
    """Context parallelism's K/V movement (`SearchOptions.cp_attention`)."""
    _tables: dict[tuple[int, int, str, int, int, int, bool], StageTable] = field(
        default_factory=dict)
    _prices: dict[tuple[int, str, int, int], LayerPrices] = field(default_factory=dict)
    _partitions: dict[tuple[int, int, bool, int, int], tuple[int, ...]] = field(
        default_factory=dict)
    _graphs: dict[tuple[int, bool, int, int], ModelGraph] = field(default_factory=dict)
    _ep_layers: dict[tuple[int, int, int], tuple[LayerProfile, ...]] = field(
        default_factory=dict)
    _schedules: OrderedDict[tuple[Any, ...], Schedule | None] = field(
        default_factory=OrderedDict)
    _schedule_ops: int = 0
    closed_forms: bool = True
    """Take the peak of the schedules that have one in closed form (`peaks.py`) without
    building them; False: from every schedule's trace (for tests)."""
    _traces: dict[tuple[str, int, int, int], HeldTrace | PeakCounts | None] = field(
        default_factory=dict)
    _rank_sums: dict[tuple[Any, ...], tuple[np.ndarray, ...]] = field(default_factory=dict)
    _updates: dict[tuple[Any, ...], tuple[np.ndarray, ...]] = field(default_factory=dict)
    _runs: ComputeRuns = field(default_factory=ComputeRuns)
    """Compute runs of the simulator, shared by configurations that differ only in ZeRO."""
    _splits: dict[tuple[str, int, int, int], bool] = field(default_factory=dict)
    """Whether each (non-cost-aware) schedule, by (name, p, m, v), has an I."""

    def schedule(self, config: PlanConfig, costs: CostModel | None = None) -> Schedule | None:
        """The compute schedule (None: it refuses these p, m, v). A cost-aware one is
        planned on the costs within `memory_limit(config)`; it is cached by their shape
        relative to the largest, to 2 digits."""
        key: tuple[Any, ...] = (config.schedule, config.pp, config.num_microbatches,
                                config.chunks)
        limit = None
        if is_cost_aware(config.schedule):
            if costs is None:
                return None
            stages = config.pp * config.chunks
            values = np.concatenate([np.asarray(costs.resolve(stages)[i]) for i in range(3)])
            key += tuple(np.round(values / values.max(), 2).tolist())
            limit = memory_limit(config)
        if key in self._schedules:
            self._schedules.move_to_end(key)  # least recently used first
            return self._schedules[key]
        try:
            made: Schedule | None = generate_schedule(
                config.schedule, config.pp, config.num_microbatches, config.chunks,
                costs=costs, memory_limit=limit)
        except ValueError:
            made = None
        # least recently used out beyond a budget of instructions: at thousands of devices
        # one schedule holds ~10^5; at tens all of them fit, and each is made once
        self._schedules[key] = made
        self._schedule_ops += _ops(made)
        while self._schedule_ops > _KEPT_OPS and len(self._schedules) > _KEPT_SCHEDULES:
            self._schedule_ops -= _ops(self._schedules.popitem(last=False)[1])
        return made

    def held_trace(self, config: PlanConfig) -> HeldTrace | PeakCounts | None:
        """When each rank's activations arrive and leave, or its closed-form peak
        (`peaks.py`; None: the schedule refuses these p, m, v). A cost-aware schedule
        depends on the costs: None here, priced by `memory`'s bound. One per (schedule,
        p, m, v), shared by the configurations that differ in anything else."""
        if is_cost_aware(config.schedule):
            return None
        name = same_trace_as(config.schedule)
        key = (name, config.pp, config.num_microbatches, config.chunks)
        if key not in self._traces:
            closed = closed_form_peaks(*key) if self.closed_forms else None
            if closed is not None:
                self._traces[key] = closed
            else:
                schedule = self.schedule(replace(config, schedule=name))
                self._traces[key] = None if schedule is None else HeldTrace.of(schedule)
        return self._traces[key]


    def predict(self, config: PlanConfig, memory: tuple[MemoryBreakdown, int], *,
                beaten_above: float = math.inf) -> Prediction | Beaten | None:
        """Simulate the schedule on the stage costs with the data-parallel reduction on each
        rank's communication lane (`_reduction`), then add the optimizer step.
        None when the schedule refuses the configuration; `Beaten` as soon as the step is
        proven longer than `beaten_above` (the simulation stops there,
        `step.compute_limits`): a step at or under it is always predicted in full."""
        table = self.table(config)
        if is_cost_aware(config.schedule):
            split = True  # planned on the costs, and they all split the backward
        else:
            plain = self.schedule(config)
            if plain is None:
                return None
            shape = (config.schedule, config.pp, config.num_microbatches, config.chunks)
            if shape not in self._splits:  # a scan of every op: once per schedule
                self._splits[shape] = any(Kind.I in map(_kind_of, stream)  # scanned in C
                                          for stream in plain.streams)
            split = self._splits[shape]
        all_to_all = expert_all_to_all(
            table, self.cluster, batch=config.microbatch_size, ep=config.ep, tp=config.tp,
            two_batch=self.two_batch_overlap and config.microbatch_size >= 2,
            routing=self.model.routing, dispatcher=self.moe_dispatcher)
        costs = table.costs(config.microbatch_size, split)
        devices = config.pp * config.dp * config.cp * config.tp
        # Megatron's scatter/gather: a stage sends 1/t of its output, the next all-gathers it
        # over NVLink (Narayanan et al. 2021, section 4.1)
        boundary = costs.boundary_bytes / config.tp
        p2p_bandwidth, p2p_latency = p2p_link(self.cluster, devices,
                                              float(np.max(boundary, initial=0)))
        if self.blocking_p2p and not (self.p2p_overlap_interleaved
                                      and config.schedule == "interleaved"):
            forward, input_grad = blocking_p2p(
                self.cluster, placement_of(config), tp=config.tp, gather=self.p2p_gather,
                devices=devices, forward=costs.forward,
                input_grad=costs.input_grad, boundary_bytes=costs.boundary_bytes)
            model = CostModel(forward=forward.tolist(), backward=input_grad.tolist(),
                              weight=costs.weight_grad.tolist(), all_to_all=all_to_all)
        else:
            model = CostModel(forward=costs.forward.tolist(),
                              backward=costs.input_grad.tolist(),
                              weight=costs.weight_grad.tolist(), comm=p2p_latency,
                              activation_bytes=boundary.tolist(), bandwidth=p2p_bandwidth,
                              all_to_all=all_to_all)
        # a cost-aware generator plans on each op's whole time, its all-to-all exposed
        schedule = self.schedule(config, exposed_in_ops(model))
        if schedule is None:
            return None
        gather = None if not self.overlap_param_gather else data_parallel.param_gather(
            table, self.cluster, dp=config.dp * config.cp, tp=config.tp,
            zero_stage=config.zero_stage, params=stage_params(table, placement_of(config)),
            ep=self.expert_shards(config), expert_grad_group=self.expert_rule(config))
        step, exposed, tied = self.update_seconds(config)
        simulated = replace(model, reduction=self._reduction(config, table), gather=gather)
        if beaten_above < math.inf:
            stopped = simulate_unless_over(schedule, simulated,
                                           compute_limits(beaten_above, step, exposed),
                                           runs=self._runs)
            if stopped is None:
                return Beaten(beaten_above)
            timeline = stopped
        else:
            timeline = simulate(schedule, simulated, runs=self._runs)
        parts = step_parts(timeline, config.pp, step, exposed, tied)
        total = float(parts.finish.max())
        # the breakdown of the rank that finishes last: its parts sum to the step
        last = int(np.argmax(parts.finish))
        ep_comm = 0.0 if all_to_all is None else exposed_all_to_all(
            timeline, model, last, config.pp * config.chunks,
            without=simulate(schedule, replace(simulated, all_to_all=None), runs=self._runs))
        breakdown = step_breakdown(parts, last, costs, np.asarray(placement_of(config)) == last,
                                   config.num_microbatches, ep_comm, step, exposed)
        tokens = self.global_batch * self.model.seq
        model_flops = 3 * self.model.flops_per_sample * self.global_batch
        return Prediction(config, total, tokens / total, model_flops / total / devices,
                          memory[0], memory[1], breakdown, table.boundaries)


_kind_of = operator.itemgetter(0)


def _ops(schedule: Schedule | None) -> int:
    return 0 if schedule is None else sum(len(stream) for stream in schedule.streams)
