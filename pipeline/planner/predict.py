"""Price one configuration: partition, memory at the schedule's peak, and the simulated step
with tensor-parallel, pipeline and data-parallel communication and the optimizer step."""

from __future__ import annotations

import functools
import math
import operator
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import pipeline.planner.data_parallel as data_parallel
from partition import ModelGraph, partition_graph
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.config import PlanConfig
from pipeline.planner.errors import PlanError
from pipeline.planner.expert_parallel import (
    expert_all_to_all,
    exposed_all_to_all,
    exposed_in_ops,
)
from pipeline.planner.memory import GRAD_BYTES, HeldTrace, MemoryBreakdown, peak_rank_memory
from pipeline.planner.p2p import blocking_p2p
from pipeline.planner.peaks import PeakCounts, closed_form_peaks, same_trace_as
from pipeline.planner.profile import ModelProfile
from pipeline.planner.stages import LayerPrices, StageTable, cost_graph, uniform_boundaries
from pipeline.planner.step import Beaten, compute_limits, step_breakdown, step_parts
from pipeline.planner.tied import (
    stage_params,
    tied_allreduce_seconds,
    tied_held,
    tied_step_reduction,
)
from schedules import (
    SCHEDULES,
    ComputeRuns,
    CostModel,
    GradReduction,
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
    tp_comm, ep_comm (the expert all-to-all, exposed), bubble (idle and P2P waits; with
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
class PlanContext:
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
    two_batch_overlap: bool = False
    """Forwards outside F&B pairs of an MoE stage run as two halves of the microbatch
    (the engine's `two_batch_overlap`, `ExpertAllToAll.two_batch`) where it has two samples
    or more."""
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
    _tables: dict[tuple[int, int, str, int], StageTable] = field(default_factory=dict)
    _prices: dict[tuple[int, str], LayerPrices] = field(default_factory=dict)
    _partitions: dict[tuple[int, int, bool], tuple[int, ...]] = field(default_factory=dict)
    _graphs: dict[tuple[int, bool], ModelGraph] = field(default_factory=dict)
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

    def table(self, config: PlanConfig) -> StageTable:
        """The stages of `config`: the exact partitioner's cuts of the one-sample layer costs
        (compute only: every cut carries the same hidden-state bytes) into p·v stages."""
        key = (config.pp * config.chunks, config.tp, config.recompute, config.recompute_layers)
        if key not in self._tables:
            # the cuts see full recomputation of every layer; selective and partial
            # recomputation are not priced per layer here (a partial one depends on the cuts
            # themselves): the other modes share one partition
            again = config.recompute == "full" and not config.recompute_layers
            if self.uniform_layers:
                uniform = uniform_boundaries(self.model.layers, key[0])
                if uniform is None:
                    raise PlanError(f"{config.label()}: {key[0]} stages do not divide the "
                                    f"model's blocks evenly (uniform_layers)")
                cuts: tuple[int, ...] = uniform
            else:
                cuts = self._cuts(key[0], config.tp, again)
            prices = self._prices.get((config.tp, config.recompute))
            if prices is None:  # shared by the tables of one tp size and recomputation mode
                prices = self._prices[config.tp, config.recompute] = LayerPrices.of(
                    self.model.layers, next(iter(self._prices.values()), None))
            self._tables[key] = StageTable.build(self.model.layers, cuts, self.cluster,
                                                 self.precision, config.tp, config.recompute,
                                                 config.recompute_layers, self.tp_overlap,
                                                 prices)
        return self._tables[key]

    def _cuts(self, stages: int, tp: int, again: bool) -> tuple[int, ...]:
        key = (stages, tp, again)
        if key not in self._partitions:
            graph = self._graphs.get((tp, again))
            if graph is None:  # one per tp size and recomputation, cut into any p·v
                graph = self._graphs[tp, again] = cost_graph(
                    self.model.layers, self.cluster, self.precision, tp, again,
                    self.tp_overlap)
            self._partitions[key] = tuple(partition_graph(graph, stages).boundaries)
        return self._partitions[key]

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

    def memory(self, config: PlanConfig, trace: HeldTrace | PeakCounts | None = None, *,
               floor: bool = False) -> tuple[MemoryBreakdown, int]:
        """The largest rank's memory and that rank: at the schedule's peak (`trace`), or
        with `floor` at one microbatch of each of the rank's stages (no schedule holds less:
        a microbatch's activations of the rank's first stage are held from its F to its
        last backward op, which waits for the backward of every later stage, so when the
        rank runs that microbatch's F of its last stage it holds one of each).
        A cost-aware schedule, without a trace, is priced at its memory limit: that many
        microbatches of the rank's largest stage (at most all it runs)."""
        table = self.table(config)
        b = config.microbatch_size
        placement = _placement(config)
        largest = np.zeros(config.pp)
        np.maximum.at(largest, np.asarray(placement), table.held * b)
        if floor:
            activations = self.rank_sums(config)[1] * b
        elif trace is not None:
            activations = trace.peak_bytes(table.held * b)
        elif is_cost_aware(config.schedule):
            activations = largest * min(memory_limit(config),
                                        config.chunks * config.num_microbatches)
        else:
            raise ValueError(f"{config.label()}: a memory needs the schedule's trace")
        return peak_rank_memory(stage_params(table, placement), activations,
                                table.workspace * b, placement, dp=config.dp,
                                zero=config.zero_stage, recompute=config.recomputes,
                                stage_gradient_bytes=self.tied_grad_bytes(config),
                                stage_expert_params=table.experts if self.model.experts
                                else None, expert_parallel=config.ep,
                                **self.engine_bytes(config))

    def tied_grad_bytes(self, config: PlanConfig) -> np.ndarray | None:
        """Per stage: this engine's second gradient of its tied weights under ZeRO-1."""
        table = self.table(config)
        if not (self.tied_reduce_at_step and config.zero_stage and table.tied.any()):
            return None
        return tied_held(table, _placement(config)) * GRAD_BYTES

    def engine_bytes(self, config: PlanConfig) -> dict[str, Any]:
        """Another engine's gradient bytes per parameter beyond this one's
        (`peak_rank_memory`): `step_gradient_bytes`, and torch DDP's buckets where it runs
        (`torch_ddp`): a copy of every gradient in the reduction's type
        (`gradient_as_bucket_view=False`, torch's default then and now)."""
        return {"extra_gradient_bytes": self.grad_reduce_bytes if self.torch_ddp(config)
                else 0.0,
                "step_gradient_bytes": self.step_gradient_bytes,
                "state_bytes": self.state_bytes}

    def torch_ddp(self, config: PlanConfig) -> bool:
        """Whether `config` runs Megatron-LM 2021's torch DDP path (pp = 1 with
        `overlap_grad_reduce_unpipelined`), not this engine's gradient buffer."""
        return (not self.overlap_grad_reduce and self.overlap_grad_reduce_unpipelined
                and config.pp == 1)

    def rank_sums(self, config: PlanConfig) -> tuple[np.ndarray, ...]:
        """Per rank: parameters, the activations of one microbatch of each of its stages
        and the recomputation workspace, per sample."""
        placement = _placement(config)
        key = (config.pp * config.chunks, config.tp, config.recompute,
               config.recompute_layers, placement)
        if key not in self._rank_sums:
            table = self.table(config)
            workspace = np.zeros(config.pp)
            np.maximum.at(workspace, np.asarray(placement), table.workspace)
            params = np.bincount(placement, weights=stage_params(table, placement),
                                 minlength=config.pp)
            each = np.bincount(placement, weights=table.held, minlength=config.pp)
            self._rank_sums[key] = (params, each, workspace)
        return self._rank_sums[key]

    def _rank_params(self, config: PlanConfig) -> np.ndarray:
        return self.rank_sums(config)[0]

    def rank_experts(self, config: PlanConfig) -> np.ndarray | None:
        """Per rank: the routed experts' parameters of its stages (all E of each layer);
        None for a dense model."""
        if not self.model.experts:
            return None
        return np.bincount(_placement(config), weights=self.table(config).experts,
                           minlength=config.pp)

    def update_seconds(self, config: PlanConfig) -> tuple[np.ndarray, ...]:
        """Per rank: optimizer step seconds, the exposed seconds around it (ZeRO-1's
        all-gather, this engine's tied-region reduction) and the tied copies' all-reduce
        before it (`tied.tied_allreduce_seconds`), per partition, placement, dp and ZeRO."""
        key = (config.pp * config.chunks, config.tp, config.recompute, config.recompute_layers,
               _placement(config), config.dp, config.zero_stage, config.ep)
        if key not in self._updates:
            self._updates[key] = self._price_update(config)
        return self._updates[key]

    def _price_update(self, config: PlanConfig) -> tuple[np.ndarray, ...]:
        table, placement = self.table(config), _placement(config)
        tied = tied_allreduce_seconds(table, placement, self.cluster, dp=config.dp,
                                      tp=config.tp, element_bytes=self.grad_reduce_bytes)
        step, exposed = data_parallel.update_seconds(
            self._rank_params(config), self.cluster, dp=config.dp, tp=config.tp,
            zero_stage=config.zero_stage, overlap_param_gather=self.overlap_param_gather,
            update_bytes=self.update_bytes, rank_experts=self.rank_experts(config),
            ep=config.ep)
        if self.tied_reduce_at_step:  # the tied region's reduction at STEP, exposed
            held = np.bincount(placement, weights=tied_held(table, placement),
                               minlength=config.pp)
            exposed = exposed + tied_step_reduction(
                held, self.cluster, dp=config.dp, tp=config.tp, zero_stage=config.zero_stage,
                element_bytes=self.grad_reduce_bytes)
        return step, exposed, tied

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
            two_batch=self.two_batch_overlap and config.microbatch_size >= 2)
        costs = table.costs(config.microbatch_size, split)
        p2p_bandwidth, p2p_latency = self.cluster.link(config.pp * config.dp * config.tp)
        # Megatron's scatter/gather: a stage sends 1/t of its output, the next all-gathers it
        # over NVLink (Narayanan et al. 2021, section 4.1)
        boundary = costs.boundary_bytes / config.tp
        if self.blocking_p2p and not (self.p2p_overlap_interleaved
                                      and config.schedule == "interleaved"):
            forward, input_grad = blocking_p2p(
                self.cluster, _placement(config), tp=config.tp, gather=self.p2p_gather,
                devices=config.pp * config.dp * config.tp, forward=costs.forward,
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
            table, self.cluster, dp=config.dp, tp=config.tp, zero_stage=config.zero_stage,
            params=stage_params(table, _placement(config)), ep=config.ep)
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
            timeline, model, last, config.pp * config.chunks)
        breakdown = step_breakdown(parts, last, costs, np.asarray(_placement(config)) == last,
                                   config.num_microbatches, ep_comm, step, exposed)
        tokens = self.global_batch * self.model.seq
        devices = config.pp * config.tp * config.dp
        model_flops = 3 * self.model.flops_per_sample * self.global_batch
        return Prediction(config, total, tokens / total, model_flops / total / devices,
                          memory[0], memory[1], breakdown, table.boundaries)

    def _reduction(self, config: PlanConfig, table: StageTable) -> GradReduction | None:
        """Each stage's data-parallel reduction (`data_parallel.grad_reduction`)."""
        overlap = self.overlap_grad_reduce or self.torch_ddp(config)
        params = stage_params(table, _placement(config))
        if self.tied_reduce_at_step:  # reduced at STEP instead (`_price_update`)
            params = params - tied_held(table, _placement(config))
        return data_parallel.grad_reduction(
            table, self.cluster, dp=config.dp, tp=config.tp, zero_stage=config.zero_stage,
            grad_reduce_bytes=self.grad_reduce_bytes, overlap=overlap, params=params,
            ep=config.ep)


def is_cost_aware(name: str) -> bool:
    """Whether schedule `name` is planned per cost model and memory limit (zb-auto,
    zb-v-auto, interleaved-zb, zb-optimal)."""
    return SCHEDULES[name].plan is not None


def memory_limit(config: PlanConfig) -> int:
    """The (stage, microbatch) activations a rank of a cost-aware schedule may hold, given
    to it explicitly so that its price and its order agree: each one's own default, as the
    registry states it (`ScheduleSpec.default_limit`: 2p; v·p for interleaved-zb, whose p
    microbatches in flight hold v stages each)."""
    return SCHEDULES[config.schedule].default_limit(config.pp, config.chunks)


def _placement(config: PlanConfig) -> tuple[int, ...]:
    """Rank of each stage, as the schedule itself places them."""
    return schedule_placement(config.schedule, config.pp, config.chunks)


@functools.lru_cache(maxsize=4096)  # asked for every configuration the search enumerates
def schedule_placement(name: str, pp: int, chunks: int) -> tuple[int, ...]:
    """Rank of each stage of schedule `name` on `pp` ranks with `chunks` per rank, as the
    registry states it (`ScheduleSpec.placement`; a list of V-shaped names kept here once
    went stale: dualpipev-overlap, V-Min and V-Half were priced on a loop)."""
    return SCHEDULES[name].placement(pp, chunks)


_kind_of = operator.itemgetter(0)


def _ops(schedule: Schedule | None) -> int:
    return 0 if schedule is None else sum(len(stream) for stream in schedule.streams)
