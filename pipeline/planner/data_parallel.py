"""Price the data-parallel side of a step: the gradient reduction and ZeRO-1's parameter
all-gather for the simulator's lane (`schedules.analysis.reduction`, `.gather`), and the update."""

from __future__ import annotations

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.memory import PARAM_BYTES
from pipeline.planner.pricing import allreduce_seconds
from pipeline.planner.stages import StageTable
from schedules import GradReduction, ParamGather

__all__ = ["ADAM_UPDATE_BYTES", "BUCKET_PARAMETERS", "grad_reduction", "param_gather",
           "stage_buckets", "update_seconds"]

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
                   grad_reduce_bytes: float, overlap: bool, params: np.ndarray | None = None
                   ) -> GradReduction | None:
    """Each stage's data-parallel reduction for the simulator, which places it on the rank's
    timeline by the engine's rule (buckets launched from the hooks of the stage's last fused
    backward as they become final, one after another on one stream; only what cannot hide
    behind that backward is exposed). ZeRO-1 reduce-scatters: half an all-reduce's traffic.
    Without `overlap`, everything starts once the rank's pipeline has drained (Narayanan et
    al. 2021). `params`: per stage, default `table.params` (`tied.stage_params` adds
    a tied copy). None where dp = 1."""
    if dp == 1:
        return None
    held = table.params if params is None else params
    seconds = [allreduce_seconds(float(count) * grad_reduce_bytes, dp, tp, cluster)
               / (2 if zero_stage else 1) for count in held]
    return GradReduction(time=seconds, buckets=stage_buckets(table, held),
                         start="overlap" if overlap else "after_flush")


def _gather_seconds(params: float, dp: int, tp: int, cluster: ClusterSpec) -> float:
    """All-gathering `params` updated parameters over `dp` ranks: half an all-reduce."""
    return allreduce_seconds(params * PARAM_BYTES, dp, tp, cluster) / 2


def param_gather(table: StageTable, cluster: ClusterSpec, *, dp: int, tp: int,
                 zero_stage: int, params: np.ndarray | None = None) -> ParamGather | None:
    """ZeRO-1's overlapped parameter all-gather per stage for the simulator (the engine's
    `overlap_param_gather`): each stage's first forward of the next step waits, layer by
    layer, for the buckets holding its parameters (`schedules.analysis.gather`; the stage's
    layers taken as equal). `params` as `grad_reduction`'s. None without ZeRO-1 or where
    dp = 1."""
    if not zero_stage or dp == 1:
        return None
    held = table.params if params is None else params
    return ParamGather(time=[_gather_seconds(float(x), dp, tp, cluster) for x in held],
                       buckets=stage_buckets(table, held), overlap=True,
                       layers=[len(stage) for stage in table.stages])


def update_seconds(rank_params: np.ndarray, cluster: ClusterSpec, *, dp: int, tp: int,
                   zero_stage: int, overlap_param_gather: bool,
                   update_bytes: float = ADAM_UPDATE_BYTES) -> tuple[np.ndarray, np.ndarray]:
    """Per rank: optimizer step seconds and the ZeRO-1 all-gather seconds exposed after it
    (blocking: all of it; with `overlap_param_gather` none here, the simulator places it)."""
    shard = rank_params / (dp if zero_stage else 1)
    step = cluster.op_overhead + shard * update_bytes / cluster.memory_bandwidth
    if not zero_stage or overlap_param_gather:
        return step, np.zeros(len(rank_params))
    # ZeRO-1: reduce-scatter before the step (overlapped), all-gather after it (exposed)
    return step, np.array([_gather_seconds(x, dp, tp, cluster) for x in rank_params])
