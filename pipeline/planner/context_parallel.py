"""Context parallelism's prices: a stage's sequence split over cp ranks, K/V all-gathered."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.errors import PlanError
from pipeline.planner.pricing import allgather_seconds
from pipeline.planner.profile import LayerProfile

if TYPE_CHECKING:
    from pipeline.planner.stages import StageCosts, StageTable

__all__ = ["context_costs", "context_table", "gather_seconds", "gathered_kv_bytes",
           "recomputed_whole"]


def gathered_kv_bytes(layer: LayerProfile, tp: int) -> float:
    """Bytes per sample of one layer's all-gathered keys and values on one tp rank: the
    whole sequence's K and V, 2·S·kv_width·element/t (0 for a layer without attention)."""
    shape = layer.shape
    if shape is None or shape.role != "block":
        return 0.0
    return 2.0 * shape.seq * shape.kv_width * shape.element / tp


def recomputed_whole(stage: tuple[LayerProfile, ...], recompute: str, k: int
                ) -> tuple[LayerProfile, ...]:
    """The layers of a stage recomputed whole (full: all, or the first k; else none)."""
    if recompute != "full":
        return ()
    return stage[:k] if k else stage


def context_table(table: StageTable, cp: int, stride: int, attention: str = "all-gather"
                  ) -> StageTable:
    """`table` as one of cp ranks holds it: its activations, recomputation workspace and
    boundary messages (all proportional to the sequence) divided by cp. The gathered K/V
    are not held: the engine's attention keeps this rank's own keys and values and gathers
    them again in the backward (`pipeline.parallel.context.gathered`); `cp_bytes` /
    `cp_again` record per stage the gathered bytes and how many layers gather them (all,
    and those recomputed whole), which `context_costs` prices. Its stage times
    (`StageTable._price`) are divided by cp. `stride`: tp, the distance of cp neighbours
    in the rank order (tp innermost, then cp). `attention`: how the K/V move
    (`StageTable.cp_attention`; the same bytes held whichever)."""
    if cp == 1:
        return table
    tp = table.tp

    def kv(layers: tuple[LayerProfile, ...]) -> tuple[float, int]:
        sizes = [gathered_kv_bytes(layer, tp) for layer in layers]
        return sum(sizes), sum(size > 0 for size in sizes)

    whole = np.array([kv(stage) for stage in table.stages])
    again = np.array([kv(recomputed_whole(stage, table.recompute, table.recompute_layers))
                      for stage in table.stages])
    if not whole[:, 0].any():
        raise PlanError("context parallelism needs a transformer shape or Hugging Face "
                        "model (its attention layers' K/V widths); a cost JSON has none")
    return replace(table, held=table.held / cp, workspace=table.workspace / cp,
                   boundary=table.boundary / cp, cp=cp, cp_bytes=whole, cp_again=again,
                   cp_stride=stride, cp_attention=attention, _priced={})


def gather_seconds(nbytes: float, cp: int, stride: int, cluster: ClusterSpec) -> float:
    """A ring all-gather (or reduce-scatter) whose whole result is `nbytes`, over cp ranks
    `stride` apart: (cp−1)/cp of the bytes through each link and cp−1 latency hops, over
    NVLink when the group fits a node (cp·stride <= devices per node), else the network;
    with `nccl_arch`, NCCL's pick for it."""
    if cluster.nccl_arch:  # NCCL's pick (`pricing.allgather_seconds`)
        return allgather_seconds(nbytes, cp, stride, cluster)
    bandwidth, latency = cluster.link(cp * stride)
    return (cp - 1) / cp * nbytes / bandwidth + (cp - 1) * latency


def _layers_seconds(table: StageTable, batch: int, again: bool) -> np.ndarray:
    """Per stage: the seconds of one K/V all-gather per attention layer (with `again`, of
    the layers recomputed whole only), summed layer by layer."""
    stride, cp, cluster = table.cp_stride, table.cp, table.cluster
    return np.array([sum(gather_seconds(gathered_kv_bytes(layer, table.tp) * batch, cp,
                                        stride, cluster)
                         for layer in (recomputed_whole(stage, table.recompute,
                                                   table.recompute_layers) if again else stage)
                         if gathered_kv_bytes(layer, table.tp) > 0)
                     for stage in table.stages])


def context_costs(table: StageTable, costs: StageCosts, batch: int) -> StageCosts:
    """`costs` of one of cp ranks (compute already divided by cp) plus, per attention layer,
    the K/V all-gather in the forward (again in a recomputed forward), and in the
    input-gradient backward the K/V all-gather again (they are not kept) and the
    reduce-scatter of their gradients, none overlapped (the engine's are not); `cp_comm`
    says how much of the ops they are."""
    gather = _layers_seconds(table, batch, again=False)
    again = _layers_seconds(table, batch, again=True)
    return replace(costs, forward=costs.forward + gather,
                   input_grad=costs.input_grad + again + 2 * gather,
                   recompute=costs.recompute + again, cp_comm=3 * gather + again)

