"""The oracle of the search's memory floor and time bound: a straightforward per-configuration
computation from the per-layer prices (`tests/planner/test_search_bounds_identity.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import numpy as np

import pipeline.planner.data_parallel as data_parallel
from partition import LayerCost, chain_graph, partition_graph
from pipeline.planner.bounds import FUSED_BACKWARD
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.memory import GRAD_BYTES, recompute_workspace, stage_activation_bytes
from pipeline.planner.peaks import warm_up_held
from pipeline.planner.predict import PlanConfig, PlanContext
from pipeline.planner.pricing import (
    allgather_seconds,
    layer_selective_seconds,
    layer_split_times,
    layer_times,
    layer_tp_pass_seconds,
    reduce_scatter_seconds,
)
from pipeline.planner.profile import LayerProfile
from pipeline.planner.runtime_memory import runtime_bytes
from pipeline.planner.stages import uniform_boundaries
from pipeline.planner.tied import tied_allreduce_seconds, tied_step_reduction
from schedules import SCHEDULES
from schedules.analysis.accounting import expert_state_bytes, model_state_bytes
from schedules.analysis.zero_exposure import ZeroLayerCosts, zero_exposed

__all__ = ["Oracle"]


def _peak_total(params: np.ndarray, held: np.ndarray, tied: np.ndarray | None,
                experts: np.ndarray | None, *, dp: int, zero: int, ep: int,
                extra_gradient_bytes: float, step_gradient_bytes: float,
                state_bytes: tuple[float, float, float] | None,
                runtime: np.ndarray | None = None) -> float:
    """`peak_rank_memory(...)[0].total` with one "stage" per rank, as it was written before
    the search kept its parts (frozen here: the floor's code under test shares it), with
    each rank's runtime bytes (`runtime_memory.runtime_bytes`) held throughout."""
    runtime = np.zeros(len(held)) if runtime is None else runtime
    states = model_state_bytes("fp32", zero_stage=zero, data_parallel=dp)
    parameters, gradients, optimizer = states.parameters, states.gradients, states.optimizer
    if state_bytes is not None:
        parameters, gradients, optimizer = state_bytes
        optimizer = optimizer / dp if zero else optimizer
    gradients, step = gradients + extra_gradient_bytes, step_gradient_bytes
    more = np.zeros(len(held)) if tied is None else tied
    expert_bytes = np.zeros(3)
    if experts is None:
        experts = np.zeros(len(held))
    elif state_bytes is not None:
        expert_bytes = np.array(state_bytes) / ep
        expert_bytes[2] *= ep / dp if zero else 1.0
    else:
        own = expert_state_bytes("fp32", expert_parallel=ep, data_parallel=dp,
                                 zero_stage=zero)
        expert_bytes = np.array([own.parameters, own.gradients + extra_gradient_bytes / ep,
                                 own.optimizer])
    expert_states = experts * expert_bytes.sum()
    during = params * (parameters + gradients + optimizer) + expert_states + more + held \
        + runtime
    at_step = params * (parameters + gradients + step + optimizer) + expert_states \
        + experts * step / ep + more + runtime
    rank = int(np.argmax(np.maximum(during, at_step)))
    activations, step_bytes = float(held[rank]), 0.0
    if at_step[rank] > during[rank]:  # the optimizer step's peak: no activations left
        gradients, activations, step_bytes = gradients + step, 0.0, step / ep
    mine = experts[rank]
    return (float(params[rank] * parameters + mine * expert_bytes[0])
            + float(params[rank] * gradients + more[rank]
                    + mine * (expert_bytes[1] + step_bytes))
            + float(params[rank] * optimizer + mine * expert_bytes[2]) + activations
            + float(runtime[rank]))


class Oracle:
    """Today's definitions, per configuration; kept only: each layer's prices, each
    partition's cuts and per-stage sums (what the test's runtime would otherwise be)."""

    def __init__(self, context: PlanContext) -> None:
        self.context = context
        self._layer_prices: dict[tuple[int, int, int, str, int, int], tuple[float, ...]] = {}
        self._cuts: dict[tuple[int, int, bool, int, int], list[Sequence[LayerProfile]]] = {}
        self._arrays: dict[tuple[Any, ...], dict[str, Any]] = {}

    def stages(self, config: PlanConfig) -> list[Sequence[LayerProfile]]:
        """The exact partitioner's cuts of the one-sample costs (or Megatron's even split)
        of the layers as ep ranks run them (`PlanContext.layers_at`)."""
        again = config.recompute == "full" and not config.recompute_layers
        key = (config.pp * config.chunks, config.tp, again, config.ep, config.cp)
        if key not in self._cuts:
            self._cuts[key] = self._stages(config)
        return self._cuts[key]

    def _stages(self, config: PlanConfig) -> list[Sequence[LayerProfile]]:
        context, tp = self.context, config.tp
        layers = context.layers_at(config.ep, config.cp, context.expert_tp(config))
        count = config.pp * config.chunks
        if context.uniform_layers:
            cuts = uniform_boundaries(layers, count)
            assert cuts is not None
        else:
            again = config.recompute == "full" and not config.recompute_layers
            costs = []
            for layer in layers:
                forward, backward = layer_times(layer, context.cluster, context.precision, 1,
                                                tp, context.tp_overlap)
                costs.append(LayerCost(layer.name, forward=forward,
                                       backward=backward + (forward if again else 0.0)))
            cuts = tuple(partition_graph(chain_graph(costs), count).boundaries)
        return [layers[a:b] for a, b in pairwise(cuts)]

    def arrays(self, config: PlanConfig) -> dict[str, Any]:
        """Per stage: parameters, tied parameters, held and workspace bytes per sample,
        experts; the placement."""
        key = (config.pp, config.chunks, config.tp, config.recompute, config.recompute_layers,
               config.schedule, config.cp, config.ep)
        if key not in self._arrays:
            self._arrays[key] = self._stage_arrays(config)
        return self._arrays[key]

    def _stage_arrays(self, config: PlanConfig) -> dict[str, Any]:
        stages, tp, cp = self.stages(config), config.tp, config.cp
        mode = (config.recompute, config.recompute_layers)
        # context parallelism: sequence-proportional bytes / cp; the gathered K and V are
        # gathered again in the backward, not kept
        held = [stage_activation_bytes(s, tp, 1, *mode) / cp for s in stages]
        return {"params": np.array([sum(layer.params(tp) for layer in s) for s in stages]),
                "tied": np.array([sum(layer.tied_params_split / tp for layer in s)
                                  for s in stages]),
                "held": np.array(held),
                "workspace": np.array([recompute_workspace(s, tp, 1, *mode) for s in stages])
                / cp,
                "experts": np.array([sum(layer.expert_params for layer in s)
                                     for s in stages]),
                "placement": SCHEDULES[config.schedule].placement(config.pp, config.chunks),
                "stages": stages}

    def floor(self, config: PlanConfig) -> float:
        """`PlanContext.memory(floor=True)`'s total, or for zb-v and dualpipev their first
        release's held activations (`peaks.warm_up_held`) instead of one of each stage."""
        context, pp, b = self.context, config.pp, config.microbatch_size
        a = self.arrays(config)
        where = np.asarray(a["placement"])
        copies = np.where(where != where[0], a["tied"], 0.0)
        params = np.bincount(where, weights=a["params"] + copies, minlength=pp)
        warm = warm_up_held(config.schedule, pp, config.num_microbatches, config.chunks)
        each = np.bincount(where, weights=a["held"], minlength=pp) if warm is None \
            else warm.peak_bytes(a["held"])
        workspace = np.zeros(pp)
        np.maximum.at(workspace, where, a["workspace"])
        held = each * b + workspace * b if config.recomputes else each * b
        tied = None
        if context.tied_reduce_at_step and config.zero_stage and a["tied"].any():
            tied_held = copies.astype(float)
            tied_held[0] += float(a["tied"].max(initial=0.0))
            tied = np.bincount(where, weights=tied_held * GRAD_BYTES, minlength=pp)
        experts = np.bincount(where, weights=a["experts"], minlength=pp) \
            if context.model.experts else None
        tied_ranks = [int(where[0]), *where[np.flatnonzero(copies > 0)].tolist()] \
            if (copies > 0).any() else []
        return _peak_total(params, held, tied, experts, dp=config.dp * config.cp,
                           zero=config.zero_stage,
                           ep=context.expert_shards(config), **context.engine_bytes(config),
                           runtime=runtime_bytes(context.cluster, config, a["placement"],
                                                 tied_ranks))

    def _prices(self, layer: LayerProfile, index: int, b: int, tp: int, recompute: str,
                ep: int, cp: int) -> tuple[float, ...]:
        key = (index, b, tp, recompute, ep, cp)
        if key not in self._layer_prices:
            context = self.context
            args = (context.cluster, context.precision, b, tp)
            times = layer_times(layer, *args, context.tp_overlap)
            split = layer_split_times(layer, *args, context.tp_overlap)
            comm = layer_tp_pass_seconds(layer, *args, context.tp_overlap)
            again = {"none": 0.0, "full": times[0] if layer.checkpointed else 0.0,
                     "selective": layer_selective_seconds(layer, *args)}[recompute]
            self._layer_prices[key] = (*times, *split, comm[0] + comm[1], again)
        return self._layer_prices[key]

    def costs(self, config: PlanConfig, stages: list[Sequence[LayerProfile]], split: bool
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per stage at b samples: forward, input gradient (recomputation in it) and weight
        gradient, each op paying the runtime's fixed cost once; a fused backward halved."""
        index = {id(layer): i
                 for i, layer in enumerate(self.context.layers_at(
                     config.ep, config.cp, self.context.expert_tp(config)))}
        b, tp, overhead = config.microbatch_size, config.tp, self.context.cluster.op_overhead
        rows = []
        for stage in stages:
            prices = [self._prices(layer, index[id(layer)], b, tp, config.recompute,
                                   config.ep, config.cp) for layer in stage]
            sums = [sum(p[i] for p in prices) / config.cp + overhead for i in range(4)]
            k = config.recompute_layers or len(stage)
            again = sum(p[5] for p in prices[:k]) / config.cp
            if config.recompute != "none":
                again += overhead
            forward, backward, input_grad, weight_grad = sums
            if not split:
                input_grad, weight_grad = backward / 2, backward / 2
            if config.cp > 1:  # a K/V all-gather per attention layer forward, and again
                # where recomputed; in the input gradient the all-gather again (K/V are not
                # kept) and their gradients' reduce-scatter
                each = {id(layer): _cp_ring(_kv(layer, tp) * b, config, self.context.cluster)
                        for layer in stage if _kv(layer, tp) > 0}
                gather = sum(each.get(id(layer), 0.0) for layer in stage)
                regather = sum(each.get(id(layer), 0.0) for layer in _whole(stage, config))
                rows.append((forward + gather, input_grad + again + regather + 2 * gather,
                             weight_grad))
                continue
            rows.append((forward, input_grad + again, weight_grad))
        forward, input_grad, weight_grad = (np.array(column) for column in zip(*rows,
                                                                              strict=True))
        return forward, input_grad, weight_grad

    def bound(self, config: PlanConfig) -> float:
        """`SearchBounds.lower_bound`'s definition (its docstring), per configuration."""
        pp, m = config.pp, config.num_microbatches
        a = self.arrays(config)
        placement, where = a["placement"], np.asarray(a["placement"])
        forward, fused_i, fused_w = self.costs(config, a["stages"], split=False)
        _, split_i, split_w = self.costs(config, a["stages"], split=True)
        fused = fused_i + fused_w
        if config.schedule in FUSED_BACKWARD:
            totals, chain = forward + fused_i + fused_w, fused
        else:
            totals = np.minimum(forward + fused_i + fused_w, forward + split_i + split_w)
            chain = np.minimum(split_i, fused)
        first = np.array([placement.index(rank) for rank in range(pp)])
        fill = np.concatenate([[0.0], np.cumsum(forward)])[first]
        busy = np.bincount(where, weights=totals, minlength=pp)
        chain_work = np.bincount(where, weights=forward + chain, minlength=pp)
        chain_back = np.concatenate([[0.0], np.cumsum(chain)])[first]
        step, gather, tied = self.update(config, a)
        step = step + tied
        bound = float((fill + m * busy + step + gather).max())
        head = placement[0]
        drain = fill + m * chain_work + chain_back + step[head] + gather[head]
        return max(bound, float(drain.max()))

    def update(self, config: PlanConfig, a: dict[str, Any]) -> tuple[np.ndarray, ...]:
        """`PlanContext.update_seconds`: the step, what is exposed around it, the tied
        all-reduce before it."""
        context, pp, where = self.context, config.pp, np.asarray(a["placement"])
        table = SimpleNamespace(tied=a["tied"])
        copies = np.where(where != where[0], a["tied"], 0.0)
        dp = config.dp * config.cp  # gradients reduced over dp × cp
        tied = tied_allreduce_seconds(table, a["placement"], context.cluster,  # type: ignore[arg-type]
                                      dp=dp, tp=config.tp,
                                      element_bytes=context.grad_reduce_bytes)
        experts = np.bincount(where, weights=a["experts"], minlength=pp) \
            if context.model.experts else None
        step, exposed = data_parallel.update_seconds(
            np.bincount(where, weights=a["params"] + copies, minlength=pp), context.cluster,
            dp=dp, tp=config.tp, zero_stage=config.zero_stage,
            overlap_param_gather=context.overlap_param_gather,
            update_bytes=context.update_bytes, rank_experts=experts,
            ep=context.expert_shards(config))
        if context.tied_reduce_at_step:
            tied_held = copies.astype(float)
            tied_held[0] += float(a["tied"].max(initial=0.0))
            exposed = exposed + tied_step_reduction(
                np.bincount(where, weights=tied_held, minlength=pp), context.cluster,
                dp=dp, tp=config.tp, zero_stage=config.zero_stage,
                element_bytes=context.grad_reduce_bytes)
        if config.zero_stage >= 2 and dp > 1:
            routed = a["experts"] if context.model.experts else np.zeros(len(copies))
            folded = config.ep == 1 and config.tp == 1  # experts replicated like the rest
            shards = context.expert_shards(config)
            exposed = exposed + self.sharded(config, a, a["params"] + copies
                                             + (routed if folded else 0.0),
                                             0.0 * routed if folded else routed / shards)
        return step, exposed, tied

    def sharded(self, config: PlanConfig, a: dict[str, Any], held: np.ndarray,
                experts: np.ndarray) -> np.ndarray:
        """ZeRO-2/3 per stage: the engine's rule (`zero_exposure.zero_exposed`) on its layers
        taken as equal, each a share of the stage's F and fused B, its reduce-scatter (half
        an all-reduce of its gradients) and ZeRO-3's all-gather of its fp32 parameters: the
        dense ones (`held`) over the dp × cp ranks (t apart), a rank's experts (`experts`)
        over the t · dp · cp / ep ranks holding the same ones (ep apart); what waits in the
        forwards and backwards (the step's wait is the simulator's)."""
        cluster, dp, tp = self.context.cluster, config.dp * config.cp, config.tp
        group = tp * dp // config.ep
        forward, fused_i, fused_w = self.costs(config, a["stages"], split=False)
        seconds = np.zeros(config.pp)
        for count, mine, stage, rank, f, b in zip(held, experts, a["stages"], a["placement"],
                                                  forward, fused_i + fused_w, strict=True):
            if not count and not mine:
                continue
            n = max(1, len(stage))
            count, mine = float(count) / n, float(mine) / n
            gather = allgather_seconds(count * 4.0, dp, tp, cluster)
            reduce = reduce_scatter_seconds(count * self.context.grad_reduce_bytes, dp, tp,
                                            cluster)
            if mine and group > 1:
                gather += allgather_seconds(mine * 4.0, group, config.ep, cluster)
                reduce += reduce_scatter_seconds(mine * self.context.grad_reduce_bytes,
                                                 group, config.ep, cluster)
            layer = ZeroLayerCosts(
                forward=float(f) / n, weight_grad=float(b) / (2 * n),
                input_grad=float(b) / (2 * n),
                gather=gather if config.zero_stage == 3 else 0.0, reduce=reduce)
            exposure = zero_exposed([layer] * n, zero_stage=config.zero_stage,
                                    microbatches=config.num_microbatches)
            seconds[rank] += exposure.forward + exposure.backward
        return seconds


def _cp_ring(nbytes: float, config: PlanConfig, cluster: ClusterSpec) -> float:
    """A ring all-gather of `nbytes` over the cp ranks (t apart): NCCL's pick on a cluster
    with `nccl_arch`, else (cp-1)/cp of the bytes through each link and cp-1 latency hops."""
    if cluster.nccl_arch:
        return allgather_seconds(nbytes, config.cp, config.tp, cluster)
    bandwidth, latency = cluster.link(config.cp * config.tp)
    return (config.cp - 1) / config.cp * nbytes / bandwidth + (config.cp - 1) * latency


def _kv(layer: LayerProfile, tp: int) -> float:
    """A block's whole-sequence K and V per sample on one tp rank, from its shape."""
    shape = layer.shape
    if shape is None or shape.role != "block":
        return 0.0
    return 2.0 * shape.seq * shape.kv_width * shape.element / tp


def _whole(stage: Sequence[LayerProfile], config: PlanConfig) -> Sequence[LayerProfile]:
    """The layers of a stage recomputed whole (full: all of them, or the first k)."""
    if config.recompute != "full":
        return ()
    return stage[:config.recompute_layers] if config.recompute_layers else stage
