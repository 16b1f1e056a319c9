"""Expert parallelism in the search: which ep sizes a grid point allows, and the expert
all-to-all a MoE stage pays inside each F and B (`schedules.analysis.all_to_all`).

Legend: E routed experts per MoE layer, k top-k, h hidden, s sequence, b microbatch, e
bytes of an activation element, d data-parallel replicas, ep the ranks splitting the
experts (consecutive dp replicas, tp ranks apart: `pipeline.parallel.topology`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.stages import StageTable
from schedules.analysis.all_to_all import ExpertAllToAll

__all__ = ["all_to_all_seconds", "expert_all_to_all", "expert_sizes"]


def expert_sizes(dp: int, experts: int, allowed: Sequence[int] | None = None, *,
                 tp: int = 1, overlap_param_gather: bool = False) -> list[int]:
    """The ep sizes the engine runs at this grid point: ep divides dp (the experts are
    split over dp replicas) and the E experts (E / ep each); above 1 only at tp = 1 and
    without overlap_param_gather (`ParallelConfig` refuses those with expert_parallel);
    among `allowed` when given. A dense model (E = 0): [1]."""
    if not experts:
        return [1]
    sizes = [ep for ep in range(1, dp + 1) if dp % ep == 0 and experts % ep == 0
             and (ep == 1 or (tp == 1 and not overlap_param_gather))]
    return [ep for ep in sizes if allowed is None or ep in allowed]


def all_to_all_seconds(nbytes: float, ep: int, stride: int, cluster: ClusterSpec) -> float:
    """One all-to-all in which each of `ep` ranks, `stride` apart in the rank order, sends
    `nbytes` spread evenly over the group (balanced routing: nbytes / ep to each member,
    its own share kept). Every pair exchanges at once (NCCL's all-to-all, one send and one
    receive per peer): the members on the rank's node over NVLink, the others through its
    share of the node's network cards, the slower of the two bounding it, each paying its
    link's latency once."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    local = max(1, min(ep, cluster.devices_per_node // stride))  # members on one node
    piece = nbytes / ep
    seconds = 0.0
    if local > 1:
        bandwidth, latency = cluster.link(1)
        seconds = latency + (local - 1) * piece / bandwidth
    if ep > local:
        bandwidth, latency = cluster.link(cluster.devices_per_node + 1)
        seconds = max(seconds, latency + (ep - local) * piece / bandwidth)
    return seconds


def expert_all_to_all(table: StageTable, cluster: ClusterSpec, *, batch: int, ep: int,
                      tp: int = 1) -> ExpertAllToAll | None:
    """Each stage's expert all-to-all inside one microbatch of `batch` samples: every MoE
    layer dispatches each token's hidden state to its k experts and combines their outputs
    back, two all-to-alls of s·k·h·e bytes per sample (`LayerProfile.all_to_all_bytes`),
    in the forward; the backward sends the gradients of both the other way, two more. None
    where nothing is exchanged (ep = 1, or a dense model)."""
    if ep <= 1 or not table.moe_layers.any():
        return None
    seconds = np.array([
        2 * count * all_to_all_seconds(total / count * batch, ep, tp, cluster) if count
        else 0.0 for count, total in zip(table.moe_layers, table.all_to_all, strict=True)])
    return ExpertAllToAll(forward=seconds.tolist(), backward=seconds.tolist())
