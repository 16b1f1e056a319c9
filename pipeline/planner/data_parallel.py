"""Price the data-parallel side of a step: the gradient reduction and ZeRO-1's parameter
all-gather for the simulator's lane (`schedules.analysis.reduction`, `.gather`), and the update."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.expert_grad_sync import engine_expert_group
from pipeline.planner.memory import PARAM_BYTES
from pipeline.planner.pricing import (
    allgather_seconds,
    allreduce_seconds,
    reduce_scatter_seconds,
)
from pipeline.planner.stages import StageTable
from schedules import GradReduction, ParamGather
from schedules.analysis.zero_exposure import ZeroLayerCosts, zero_exposed

__all__ = ["ADAM_UPDATE_BYTES", "BUCKET_PARAMETERS", "grad_reduction", "param_gather",
           "sharded_comm_seconds", "stage_buckets", "update_seconds"]

BUCKET_PARAMETERS = 40_000_000
"""Gradients a data-parallel bucket holds: Megatron's default (`--ddp-bucket-size`, 40M
elements); the engine's hooks launch one bucket's reduction as soon as it is full."""
ADAM_UPDATE_BYTES = 7 * 4.0
"""Memory traffic of this engine's update per parameter: Adam reads the fp32 parameter,
gradient and both moments and writes parameter and moments (a memory-bound step)."""


def stage_buckets(table: StageTable, params: np.ndarray | None = None) -> list[int]:
    """Buckets per stage: its parameters (`params`, default `table.params`) in
    `BUCKET_PARAMETERS` (the reduce-scatter's and the all-gather's: ZeRO-1 shards each
    bucket, `pipeline.parallel.zero_layout`)."""
    held = table.params if params is None else params
    return [max(1, -(-int(count) // BUCKET_PARAMETERS)) for count in held]


def grad_reduction(table: StageTable, cluster: ClusterSpec, *, dp: int, tp: int, zero_stage: int,
                   grad_reduce_bytes: float, overlap: bool, params: np.ndarray | None = None,
                   ep: int = 1, expert_grad_group: str = "megatron"
                   ) -> GradReduction | None:
    """Each stage's data-parallel reduction for the simulator, which places it on the rank's
    timeline by the engine's rule (buckets launched from the hooks of the stage's last fused
    backward as they become final, one after another on one stream; only what cannot hide
    behind that backward is exposed). ZeRO-1 reduce-scatters (`pricing.reduce_scatter_seconds`).
    Without `overlap`, everything starts once the rank's pipeline has drained (Narayanan et
    al. 2021). `params`: per stage, default `table.params` (`tied.stage_params` adds a tied
    copy). The routed experts' gradients (`StageTable.experts`): each rank's 1/ep of them
    over the t · dp / ep ranks holding the same experts (`expert_grad_sync.engine_expert_group`;
    `Topology.expert_dp_group` at t = 1), after the dense ones on the same stream; with the
    rest at ep = t = 1. None where dp = 1 (at t > 1 a MoE stage's experts, whole on each tp
    rank, are still reduced over them). `expert_grad_group`: whose expert group
    (`expert_grad_sync.engine_expert_group`: this engine's d / ep ranks of one tp rank,
    its tp sum priced in the backward instead, or Megatron-Core's t · d / ep)."""
    if dp == 1 and (tp == 1 or not np.any(table.experts)):
        return None
    held = table.params if params is None else params
    held, experts = _with_experts(held, table.experts, ep, tp, expert_grad_group)

    def reduce(count: float, group: int, stride: int) -> float:
        if not count:  # no experts here: no second collective, not even its latency
            return 0.0
        if zero_stage:
            return reduce_scatter_seconds(count * grad_reduce_bytes, group, stride, cluster)
        return allreduce_seconds(count * grad_reduce_bytes, group, stride, cluster)

    group, stride = engine_expert_group(dp, tp, ep, expert_grad_group)
    seconds = [reduce(float(count), dp, tp) + reduce(float(mine), group, stride)
               for count, mine in zip(held, experts, strict=True)]
    return GradReduction(time=seconds, buckets=stage_buckets(table, held + experts),
                         start="overlap" if overlap else "after_flush")


def _with_experts(params: np.ndarray, experts: np.ndarray, ep: int, tp: int,
                  rule: str = "megatron") -> tuple[np.ndarray, np.ndarray]:
    """(parameters reduced over dp, expert parameters one rank holds, reduced over their
    group, `expert_grad_sync.engine_expert_group`): at ep = tp = 1 the experts are
    replicated like the rest and reduced with them (at tp > 1 they are whole on every tp
    rank, the rest split: Megatron-Core's two groups even at ep = 1; this engine's
    "tp_rank" group is then the dense one, reduced with the rest)."""
    if ep == 1 and (tp == 1 or rule == "tp_rank"):
        return params + experts, np.zeros(len(params))
    return params, experts / ep


def _gather_seconds(params: float, dp: int, tp: int, cluster: ClusterSpec) -> float:
    """All-gathering `params` updated parameters over `dp` ranks (`allgather_seconds`)."""
    return allgather_seconds(params * PARAM_BYTES, dp, tp, cluster)


def param_gather(table: StageTable, cluster: ClusterSpec, *, dp: int, tp: int,
                 zero_stage: int, params: np.ndarray | None = None, ep: int = 1,
                 expert_grad_group: str = "megatron") -> ParamGather | None:
    """ZeRO-1's overlapped parameter all-gather per stage for the simulator (the engine's
    `overlap_param_gather`): each stage's first forward of the next step waits, layer by
    layer, for the buckets holding its parameters (`schedules.analysis.gather`; the stage's
    layers taken as equal). `params` as `grad_reduction`'s. At ep > 1 the dense parameters
    are gathered over dp and the stage's 1/ep of the experts over their group
    (`expert_grad_sync.engine_expert_group`), one after the other on the lane (the engine gathers
    each half over its own group). None without ZeRO-1/2 or where dp = 1 (ZeRO-3 gathers
    before every use: `sharded_comm_seconds`)."""
    if not zero_stage or zero_stage == 3 or dp == 1:
        return None
    dense, experts = _with_experts(table.params if params is None else params,
                                   np.asarray(table.experts, dtype=float), ep, tp,
                                   expert_grad_group)
    group, stride = engine_expert_group(dp, tp, ep, expert_grad_group)
    times = [_gather_seconds(float(x), dp, tp, cluster)
             + (_gather_seconds(float(mine), group, stride, cluster)
                if mine and group > 1 else 0.0)
             for x, mine in zip(dense, experts, strict=True)]
    return ParamGather(time=times, buckets=stage_buckets(table, dense + experts), overlap=True,
                       layers=[len(stage) for stage in table.stages])


def update_seconds(rank_params: np.ndarray, cluster: ClusterSpec, *, dp: int, tp: int,
                   zero_stage: int, overlap_param_gather: bool,
                   update_bytes: float = ADAM_UPDATE_BYTES,
                   rank_experts: np.ndarray | None = None, ep: int = 1,
                   expert_grad_group: str = "megatron") -> tuple[np.ndarray, np.ndarray]:
    """Per rank: optimizer step seconds and the ZeRO-1 all-gather seconds exposed after it
    (blocking: all of it; with `overlap_param_gather` none here, the simulator places it).
    `rank_experts`: the routed experts' parameters per rank (all E), of which it steps 1/ep,
    ZeRO-1's shard of them 1/(t · dp / ep), gathered over that group
    (`expert_grad_sync.engine_expert_group`). ZeRO-2 keeps ZeRO-1's gather after the step; ZeRO-3
    has none there (its gathers: `sharded_comm_seconds`)."""
    experts = np.zeros(len(rank_params)) if rank_experts is None else rank_experts
    rank_params, experts = _with_experts(rank_params, experts, ep, tp, expert_grad_group)
    group, stride = engine_expert_group(dp, tp, ep, expert_grad_group)
    shard = rank_params / (dp if zero_stage else 1) + experts / (group if zero_stage else 1)
    step = cluster.op_overhead + shard * update_bytes / cluster.memory_bandwidth
    if not zero_stage or zero_stage == 3 or overlap_param_gather:
        return step, np.zeros(len(rank_params))
    # ZeRO-1: reduce-scatter before the step (overlapped), all-gather after it (exposed)
    return step, np.array([_gather_seconds(x, dp, tp, cluster)
                           + (_gather_seconds(mine, group, stride, cluster) if mine
                              else 0.0)
                           for x, mine in zip(rank_params, experts, strict=True)])


def sharded_comm_seconds(stage_params: np.ndarray, stage_layers: Sequence[int],
                         placement: Sequence[int], cluster: ClusterSpec, *, dp: int, tp: int,
                         zero_stage: int, num_microbatches: int, grad_reduce_bytes: float,
                         forward: np.ndarray, backward: np.ndarray,
                         stage_experts: np.ndarray | None = None, ep: int = 1,
                         expert_grad_group: str = "megatron") -> np.ndarray:
    """Per rank: the seconds ZeRO-2/3 add to the step beyond ZeRO-1's collectives, exposed
    (zeros at ZeRO-0/1 or dp = 1). `stage_params`: per stage, the parameters one tp rank
    holds besides the routed experts; `stage_experts`: per stage, the routed experts'
    parameters (all E; None for a dense model); `stage_layers`: its layers (ZeRO-3's
    units); `placement`: each stage's rank; `forward`, `backward`: each stage's seconds a
    microbatch. `dp`: the ranks sharding the dense parameters, dp · cp with context
    parallelism (`Topology.dp_group`: the stage's dp × cp ranks, tp apart in the rank order).

    The engine's rule (`schedules.analysis.zero_exposure`, the one its emulated runs follow
    to the tick, `tests/rehearsal/test_emulated_zero.py`), per stage, its layers taken as
    equal, its ops back to back, each layer one reduce-scatter bucket: ZeRO-2 and 3
    reduce-scatter every backward's gradients (`pipeline.parallel.zero2`) as layers finish,
    hidden behind the backward and the next forward unless the link falls behind; ZeRO-3
    all-gathers each layer before its forward and its backward (`reshard_after_forward`, the
    engine's default) and prefetches the next layer's (`prefetch_next_unit`, also the
    default), so a gather hides behind the previous layer's compute. With experts split
    (ep > 1, or tp > 1) each layer is two units (`pipeline.parallel.expert_zero3`): its
    dense parameters gathered and reduce-scattered over the dp ranks, its 1/ep of the
    experts over the ranks holding the same ones (`expert_grad_sync.engine_expert_group`; none where
    that group is one rank), one after the other on the link. What the step waits for, the
    last backward's reductions, is the simulator's (`grad_reduction`, as ZeRO-1's), and
    ZeRO-2's all-gather after the step `update_seconds`'."""
    if zero_stage < 2 or dp == 1:
        return np.zeros(max(placement, default=-1) + 1)
    seconds = np.zeros(max(placement) + 1)
    dense, experts = _with_experts(np.asarray(stage_params, dtype=float),
                                   np.zeros(len(placement)) if stage_experts is None
                                   else np.asarray(stage_experts, dtype=float), ep, tp,
                                   expert_grad_group)
    group, stride = engine_expert_group(dp, tp, ep, expert_grad_group)

    def collectives(count: float, mine: float) -> tuple[float, float]:
        """(all-gather, reduce-scatter) seconds of one layer's `count` dense and `mine`
        expert parameters, each over its own group."""
        gather = _gather_seconds(count, dp, tp, cluster) if zero_stage == 3 else 0.0
        reduce = reduce_scatter_seconds(count * grad_reduce_bytes, dp, tp, cluster)
        if mine and group > 1:
            if zero_stage == 3:
                gather += _gather_seconds(mine, group, stride, cluster)
            reduce += reduce_scatter_seconds(mine * grad_reduce_bytes, group, stride, cluster)
        return gather, reduce

    for count, mine, layers, rank, f, b in zip(dense, experts, stage_layers, placement,
                                               forward, backward, strict=True):
        if not count and not mine:
            continue
        units = max(1, int(layers))
        gather, reduce = collectives(float(count) / units, float(mine) / units)
        layer = ZeroLayerCosts(
            forward=float(f) / units, weight_grad=float(b) / (2 * units),
            input_grad=float(b) / (2 * units), gather=gather, reduce=reduce)
        exposure = zero_exposed([layer] * units, zero_stage=zero_stage,
                                microbatches=num_microbatches)
        seconds[rank] += exposure.forward + exposure.backward
    return seconds
