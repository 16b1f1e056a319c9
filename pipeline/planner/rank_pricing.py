"""Per configuration: stage tables, each rank's memory, optimizer update, dp reduction."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import numpy as np

import pipeline.planner.data_parallel as data_parallel
from partition import ModelGraph, partition_graph
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.config import PlanConfig
from pipeline.planner.context_parallel import context_table
from pipeline.planner.errors import PlanError
from pipeline.planner.expert_grad_sync import (
    expert_replicas,
    tp_gradient_step_seconds,
    tp_gradient_sum_seconds,
)
from pipeline.planner.memory import GRAD_BYTES, HeldTrace, MemoryBreakdown, peak_rank_memory
from pipeline.planner.peaks import PeakCounts
from pipeline.planner.profile import LayerProfile, ModelProfile
from pipeline.planner.runtime_memory import runtime_bytes
from pipeline.planner.stages import LayerPrices, StageTable, cost_graph, uniform_boundaries
from pipeline.planner.tied import (
    stage_params,
    tied_allreduce_seconds,
    tied_held,
    tied_step_reduction,
)
from schedules import SCHEDULES, GradReduction

__all__ = ["RankPricing", "is_cost_aware", "memory_limit", "placement_of",
           "schedule_placement"]


class RankPricing:
    """`PlanContext`'s stage tables and per-rank prices (its fields, documented there, are
    declared here for the methods that read them)."""

    model: ModelProfile
    cluster: ClusterSpec
    precision: str
    step_gradient_bytes: float
    update_bytes: float
    overlap_grad_reduce: bool
    overlap_grad_reduce_unpipelined: bool
    uniform_layers: bool
    grad_reduce_bytes: float
    overlap_param_gather: bool
    tied_reduce_at_step: bool
    tp_overlap: str
    state_bytes: tuple[float, float, float] | None
    routing_imbalance: float | None
    expert_grad_group: str
    cp_attention: str
    _tables: dict[tuple[int, int, str, int, int, int, bool], StageTable]
    _prices: dict[tuple[int, str, int, int], LayerPrices]
    expert_tensor_parallel: bool
    _partitions: dict[tuple[int, int, bool, int, int], tuple[int, ...]]
    _graphs: dict[tuple[int, bool, int, int], ModelGraph]
    _ep_layers: dict[tuple[int, int, int], tuple[LayerProfile, ...]]
    _rank_sums: dict[tuple[Any, ...], tuple[np.ndarray, ...]]
    _updates: dict[tuple[Any, ...], tuple[np.ndarray, ...]]

    def table(self, config: PlanConfig) -> StageTable:
        """The stages of `config`: the exact partitioner's cuts of the one-sample layer costs
        (compute only: every cut carries the same hidden-state bytes) into p·v stages."""
        key = (config.pp * config.chunks, config.tp, config.recompute, config.recompute_layers,
               config.cp, config.ep, self._per_backward_tp_sum(config))
        if key not in self._tables:
            layers = self.layers_at(config.ep, config.cp, self.expert_tp(config))
            # the cuts see full recomputation of every layer; selective and partial
            # recomputation are not priced per layer here (a partial one depends on the cuts
            # themselves): the other modes share one partition
            again = config.recompute == "full" and not config.recompute_layers
            if self.uniform_layers:
                uniform = uniform_boundaries(layers, key[0])
                if uniform is None:
                    raise PlanError(f"{config.label()}: {key[0]} stages do not divide the "
                                    f"model's blocks evenly (uniform_layers)")
                cuts: tuple[int, ...] = uniform
            else:
                cuts = self._cuts(key[0], config.tp, again, config.ep, config.cp,
                                  self.expert_tp(config))
            prices = self._prices.get((config.tp, config.recompute, config.ep, config.cp))
            if prices is None:  # shared by the tables of one tp, recomputation, ep and cp
                prices = self._prices[config.tp, config.recompute, config.ep, config.cp] = \
                    LayerPrices.of(layers, next(iter(self._prices.values()), None))
            table = context_table(StageTable.build(
                layers, cuts, self.cluster, self.precision, config.tp,
                config.recompute, config.recompute_layers, self.tp_overlap, prices),
                config.cp, config.tp, attention=self.cp_attention)
            if self._per_backward_tp_sum(config):
                # this engine's hooks under ZeRO-2 / 3: the MoE gradients summed over tp
                # every backward (ZeRO-0 / 1: once a step, `_price_update`)
                table = replace(table, grad_sum=tp_gradient_sum_seconds(
                    table.stages, self.cluster, tp=config.tp, ep=config.ep,
                    gradient_bytes=self.gradient_bytes,
                    split_experts=self.expert_tp(config) > 1))
            self._tables[key] = table
        return self._tables[key]

    def _per_backward_tp_sum(self, config: PlanConfig) -> bool:
        return self._tp_sum(config) and config.zero_stage >= 2

    def _tp_sum(self, config: PlanConfig) -> bool:
        """Whether this engine's rule sums MoE gradients over tp (`expert_grad_sync`)."""
        return self.expert_grad_group == "tp_rank" and config.tp > 1 and bool(self.model.experts)

    @property
    def gradient_bytes(self) -> float:
        """Bytes of a gradient element as the engine keeps it: this engine's fp32 (`GRAD_BYTES`,
        also under autocast) or another engine's `state_bytes`."""
        return GRAD_BYTES if self.state_bytes is None else float(self.state_bytes[1])

    def _cuts(self, stages: int, tp: int, again: bool, ep: int, cp: int = 1, etp: int = 1
              ) -> tuple[int, ...]:
        key = (stages, tp, again, ep, cp)  # etp follows tp
        if key not in self._partitions:
            graph = self._graphs.get((tp, again, ep, cp))
            if graph is None:  # one per tp, recomputation, ep and cp, cut into any p·v
                graph = self._graphs[tp, again, ep, cp] = cost_graph(
                    self.layers_at(ep, cp, etp), self.cluster, self.precision, tp, again,
                    self.tp_overlap)
            self._partitions[key] = tuple(partition_graph(graph, stages).boundaries)
        return self._partitions[key]

    def layers_at(self, ep: int, cp: int = 1, etp: int = 1) -> tuple[LayerProfile, ...]:
        """The model's layers as `ep` ranks run them: each MoE block's kernel shape with its
        E/ep local experts, each rank routing its s/cp tokens (`cp`), each expert split over
        `etp` tp ranks, and the search's `routing_imbalance` (`kernels.LayerShape.routed`,
        priced by `expert_kernels`); a dense model's as they are."""
        if not self.model.experts:
            return tuple(self.model.layers)
        if (ep, cp, etp) not in self._ep_layers:
            self._ep_layers[ep, cp, etp] = tuple(
                replace(layer, shape=replace(layer.shape, routed=replace(
                    layer.shape.routed, ep=ep, cp=cp, expert_tp=etp,
                    imbalance=self.routing_imbalance)))
                if layer.shape is not None and layer.shape.routed is not None else layer
                for layer in self.model.layers)
        return self._ep_layers[ep, cp, etp]

    def expert_tp(self, config: PlanConfig) -> int:
        """Expert tensor parallelism at `config`: its tp with `expert_tensor_parallel`, else
        1 (and 1 for a dense model)."""
        return config.tp if self.expert_tensor_parallel and self.model.experts else 1

    def expert_rule(self, config: PlanConfig) -> str:
        """The expert-gradient rule at `config` (`expert_grad_sync`): the engine's, except
        that with the experts split over tp (expert tensor parallelism) no tp rank repeats
        another's experts, so both engines shard and reduce them over the d / ep ranks
        holding the same slice: "megatron"'s formula over ep · etp shards gives exactly that."""
        return self.expert_grad_group if self.expert_tp(config) == 1 else "megatron"

    def expert_shards(self, config: PlanConfig) -> int:
        """The ranks one MoE layer's experts are split over, ep · expert tp: what the memory
        and data-parallel prices take as their ep (each rank holds 1/(ep·etp) of the
        experts; the group holding the same shard, t·d/(ep·etp) ranks ep·etp apart on
        average, is `expert_parallel.expert_group` of it)."""
        return config.ep * self.expert_tp(config)


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
        placement = placement_of(config)
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
                                table.workspace * b, placement, dp=config.dp * config.cp,
                                zero=config.zero_stage, recompute=config.recomputes,
                                stage_gradient_bytes=self.tied_grad_bytes(config),
                                stage_expert_params=table.experts if self.model.experts
                                else None, expert_parallel=self.expert_shards(config),
                                expert_replicas=expert_replicas(config.tp,
                                                                self.expert_rule(config)),
                                runtime=self.runtime_bytes(config),
                                **self.engine_bytes(config))

    def runtime_bytes(self, config: PlanConfig) -> np.ndarray:
        """Per pipeline rank, what the runtime holds besides tensors
        (`runtime_memory.runtime_bytes`): the tied embeddings' group joins the first stage's
        rank and the ranks holding a copy of its tied weight."""
        table, placement = self.table(config), placement_of(config)
        copies = [placement[stage] for stage in np.flatnonzero(table.tied > 0)]
        tied = [placement[0], *copies] if copies else []
        return runtime_bytes(self.cluster, config, placement, tied)

    def tied_grad_bytes(self, config: PlanConfig) -> np.ndarray | None:
        """Per stage: this engine's second gradient of its tied weights under ZeRO-1."""
        table = self.table(config)
        if not (self.tied_reduce_at_step and config.zero_stage and table.tied.any()):
            return None
        return tied_held(table, placement_of(config)) * GRAD_BYTES

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
        placement = placement_of(config)
        key = (config.pp * config.chunks, config.tp, config.recompute,
               config.recompute_layers, placement, config.cp, config.ep)
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
        return np.bincount(placement_of(config), weights=self.table(config).experts,
                           minlength=config.pp)

    def update_seconds(self, config: PlanConfig) -> tuple[np.ndarray, ...]:
        """Per rank: optimizer step seconds, the exposed seconds around it (ZeRO-1's
        all-gather, this engine's tied-region reduction, ZeRO-2/3's per-microbatch
        collectives) and the tied copies' all-reduce
        before it (`tied.tied_allreduce_seconds`), per partition, placement, dp and ZeRO."""
        key = (config.pp * config.chunks, config.tp, config.recompute, config.recompute_layers,
               placement_of(config), config.dp, config.zero_stage, config.ep, config.cp,
               config.num_microbatches if config.zero_stage >= 2 else 0,
               config.microbatch_size if config.zero_stage >= 2 else 0)
        if key not in self._updates:
            self._updates[key] = self._price_update(config)
        return self._updates[key]

    def _price_update(self, config: PlanConfig) -> tuple[np.ndarray, ...]:
        table, placement = self.table(config), placement_of(config)
        tied = tied_allreduce_seconds(table, placement, self.cluster, dp=config.dp * config.cp,
                                      tp=config.tp, element_bytes=self.grad_reduce_bytes)
        step, exposed = data_parallel.update_seconds(
            self._rank_params(config), self.cluster, dp=config.dp * config.cp, tp=config.tp,
            zero_stage=config.zero_stage, overlap_param_gather=self.overlap_param_gather,
            update_bytes=self.update_bytes, rank_experts=self.rank_experts(config),
            ep=self.expert_shards(config), expert_grad_group=self.expert_rule(config))
        if self.tied_reduce_at_step:  # the tied region's reduction at STEP, exposed
            held = np.bincount(placement, weights=tied_held(table, placement),
                               minlength=config.pp)
            exposed = exposed + tied_step_reduction(
                held, self.cluster, dp=config.dp * config.cp, tp=config.tp,
                zero_stage=config.zero_stage,
                element_bytes=self.grad_reduce_bytes)
        if self._tp_sum(config) and config.zero_stage < 2:  # once a step, before dp's
            exposed = exposed + np.bincount(placement, weights=tp_gradient_step_seconds(
                table.stages, self.cluster, tp=config.tp, ep=config.ep,
                gradient_bytes=self.gradient_bytes,
                split_experts=self.expert_tp(config) > 1, overlap=self.overlap_grad_reduce),
                minlength=config.pp)
        if config.zero_stage >= 2:  # ZeRO-2/3's per-microbatch collectives, exposed
            costs = table.costs(config.microbatch_size)
            # dense units over dp × cp, expert units over their group (`expert_group`)
            exposed = exposed + data_parallel.sharded_comm_seconds(
                stage_params(table, placement), [len(stage) for stage in table.stages],
                placement, self.cluster, dp=config.dp * config.cp, tp=config.tp,
                zero_stage=config.zero_stage, num_microbatches=config.num_microbatches,
                grad_reduce_bytes=self.grad_reduce_bytes, forward=costs.forward,
                backward=costs.input_grad + costs.weight_grad,
                stage_experts=table.experts if self.model.experts else None,
                ep=self.expert_shards(config), expert_grad_group=self.expert_rule(config))
        return step, exposed, tied


    def _reduction(self, config: PlanConfig, table: StageTable) -> GradReduction | None:
        """Each stage's data-parallel reduction (`data_parallel.grad_reduction`)."""
        overlap = self.overlap_grad_reduce or self.torch_ddp(config)
        params = stage_params(table, placement_of(config))
        if self.tied_reduce_at_step:  # reduced at STEP instead (`_price_update`)
            params = params - tied_held(table, placement_of(config))
        return data_parallel.grad_reduction(
            table, self.cluster, dp=config.dp * config.cp, tp=config.tp,
            zero_stage=config.zero_stage, grad_reduce_bytes=self.grad_reduce_bytes,
            overlap=overlap, params=params,
            ep=self.expert_shards(config), expert_grad_group=self.expert_rule(config))


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


def placement_of(config: PlanConfig) -> tuple[int, ...]:
    """Rank of each stage, as the schedule itself places them."""
    return schedule_placement(config.schedule, config.pp, config.chunks)


@functools.lru_cache(maxsize=4096)  # asked for every configuration the search enumerates
def schedule_placement(name: str, pp: int, chunks: int) -> tuple[int, ...]:
    """Rank of each stage of schedule `name` on `pp` ranks with `chunks` per rank, as the
    registry states it (`ScheduleSpec.placement`; a list of V-shaped names kept here once
    went stale: dualpipev-overlap, V-Min and V-Half were priced on a loop)."""
    return SCHEDULES[name].placement(pp, chunks)
