"""Expert parallelism in the search: which ep sizes a grid point allows, and the expert
all-to-all a MoE stage pays inside each F and B (`schedules.analysis.all_to_all`).

Legend: E routed experts per MoE layer, k top-k, h hidden, s sequence, b microbatch, e
bytes of an activation element, d data-parallel replicas, t tensor-parallel ranks, ep the
ranks splitting the experts (consecutive dp replicas, t ranks apart:
`pipeline.parallel.topology`). With t > 1 the experts are not split over t (expert tensor
parallelism 1, Megatron-Core's default `--expert-tensor-parallel-size 1`): attention and
the dense layers split over t, each tp rank routes its s/t tokens (sequence parallelism)
through its own ep group, and the t ranks of a replica hold the same E / ep experts. With
`SearchOptions.expert_tensor_parallel` each expert is split over the t ranks too (expert
tensor parallelism t: `expert_kernels`, `pricing.expert_tp_seconds`); the all-to-all is the
same. With context parallelism ep is carved from the dp × cp replicas (d = dp · cp here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.expert_kernels import stage_load_ratio
from pipeline.planner.node_limited import ExpertRouting, off_node_scale
from pipeline.planner.profile import ModelProfile
from schedules import CostModel, Kind
from schedules.analysis.all_to_all import ExpertAllToAll
from schedules.analysis.timeline import KIND_CODES, Timeline

if TYPE_CHECKING:  # annotations only: stages prices cp through context_comm, which imports this
    from pipeline.planner.stages import StageTable

__all__ = ["all_to_all_seconds", "expert_all_to_all", "expert_group", "expert_sizes",
           "expert_tp_refusal",
           "exposed_all_to_all", "exposed_in_ops"]


def expert_sizes(dp: int, experts: int, allowed: Sequence[int] | None = None) -> list[int]:
    """The ep sizes the engine runs at this grid point: ep divides `dp`, the replicas (dp · cp
    with context parallelism: the engine carves ep from dp × cp, as Megatron-Core does) and
    the E experts (E / ep each), at any tp (experts unsplit
    over tp); among `allowed` when given. A dense model (E = 0): [1]."""
    if not experts:
        return [1]
    sizes = [ep for ep in range(1, dp + 1) if dp % ep == 0 and experts % ep == 0]
    return [ep for ep in sizes if allowed is None or ep in allowed]


def expert_tp_refusal(model: ModelProfile, tp: int) -> str:
    """Why expert tensor parallelism at `tp` cannot split `model`'s experts ("" if it can):
    tp must divide every routed expert's intermediate size f_e (the engine's
    `split_experts_over_tensor_parallel` column-splits gate/up and row-splits down)."""
    widths = {layer.shape.routed.expert_ffn for layer in model.layers
              if layer.shape is not None and layer.shape.routed is not None}
    bad = sorted(width for width in widths if width % tp)
    return f"expert_ffn {bad[0]}" if bad else ""


def expert_group(dp: int, tp: int, ep: int) -> tuple[int, int]:
    """(ranks, stride) of the group holding the same experts, over which their gradients are
    reduced and ZeRO-1 shards their optimizer state: the t ranks of each of the d / ep
    replicas with the same ep rank (expert tensor parallelism 1: Megatron-Core's expert
    data-parallel group, t·d / ep ranks). In the rank order (t innermost, then the replicas)
    its members sit in runs of t, t·ep apart: a stride of ep on average, which puts the
    right count of them on each node (`pricing.allreduce_seconds`)."""
    return tp * dp // ep, ep


def all_to_all_seconds(nbytes: float, ep: int, stride: int, cluster: ClusterSpec, *,
                       routing: ExpertRouting | None = None,
                       dispatcher: str = "alltoall") -> float:
    """One all-to-all in which each of `ep` ranks, `stride` apart in the rank order, sends
    `nbytes` (one copy per (token, expert) pair) spread evenly over the group (balanced
    routing: nbytes / ep to each member, its own share kept). Every pair exchanges at once
    (NCCL's all-to-all, one send and one receive per peer): the members on the rank's node
    over NVLink, the others through its share of the node's network cards, the slower of the
    two bounding it, each paying its link's latency once. The off-node bytes are the
    `dispatcher`'s: all of the per-expert copies (`alltoall`), or one copy per destination
    node (`deepep`: `node_limited.off_node_scale` of `routing`'s top-k and group limit)."""
    if ep <= 1 or nbytes <= 0:
        return 0.0
    local = max(1, min(ep, cluster.devices_per_node // stride))  # members on one node
    piece = nbytes / ep
    seconds = 0.0
    if local > 1:
        bandwidth, latency = cluster.link(1)
        seconds = latency + (local - 1) * piece / bandwidth
    if ep > local:
        remote = (ep - local) * piece * off_node_scale(
            routing, ep, stride, cluster.devices_per_node, dispatcher)
        bandwidth, latency = cluster.link(cluster.devices_per_node + 1)
        seconds = max(seconds, latency + remote / bandwidth)
    return seconds


def expert_all_to_all(table: StageTable, cluster: ClusterSpec, *, batch: int, ep: int,
                      tp: int = 1, two_batch: bool = False,
                      routing: ExpertRouting | None = None,
                      dispatcher: str = "alltoall") -> ExpertAllToAll | None:
    """Each stage's expert all-to-all inside one microbatch of `batch` samples: every MoE
    layer dispatches each token's hidden state to its k experts and combines their outputs
    back, two all-to-alls of s·k·h·e bytes per sample (`LayerProfile.all_to_all_bytes`),
    in the forward; the backward sends the gradients of both the other way, two more. At
    tp > 1 each tp rank sends its sequence slice, 1/t of them, over its ep group (t ranks
    apart); at cp > 1 (`table.cp`) each cp rank its own s/cp of the tokens, 1/(t·cp) of them,
    over an ep group of consecutive dp × cp replicas, still t ranks apart. None where
    nothing is exchanged (ep = 1, or a dense model). `two_batch`:
    forwards outside pairs run as two halves (`ExpertAllToAll.two_batch`). The busiest
    rank's bytes set each exchange: the even share × `expert_kernels.stage_load_ratio`.
    `routing`, `dispatcher`: the cross-node bytes (`all_to_all_seconds`)."""
    if ep <= 1 or not table.moe_layers.any():
        return None
    shards = tp * table.cp  # each rank routes its own b·s/(t·cp) tokens
    seconds = np.array([
        2 * count * all_to_all_seconds(total / count * batch / shards * stage_load_ratio(
            stage, batch=batch, tp=tp, ep=ep), ep, tp, cluster, routing=routing,
            dispatcher=dispatcher) if count else 0.0
        for count, total, stage in zip(table.moe_layers, table.all_to_all, table.stages,
                                       strict=True)])
    return ExpertAllToAll(forward=seconds.tolist(), backward=seconds.tolist(),
                          two_batch=two_batch)


def exposed_in_ops(model: CostModel) -> CostModel:
    """`model` with its expert all-to-all folded into the ops, exposed (F + forward's, I or B
    + backward's), for the cost-aware generators, which plan on op times alone; the
    simulation itself prices it on the lane (`CostModel.all_to_all`)."""
    if model.all_to_all is None:
        return model
    stages = len(model.forward) if isinstance(model.forward, Sequence) else 1
    forward, backward, _, _, _ = model.resolve(stages)
    a2a_forward = _per_stage_list(model.all_to_all.forward, stages)
    a2a_backward = _per_stage_list(model.all_to_all.backward, stages)
    return replace(model, all_to_all=None,
                   forward=[f + a for f, a in zip(forward, a2a_forward, strict=True)],
                   backward=[b + a for b, a in zip(backward, a2a_backward, strict=True)])


def _per_stage_list(value: float | Sequence[float], stages: int) -> list[float]:
    return [float(v) for v in value] if isinstance(value, Sequence) else [float(value)] * stages


def exposed_all_to_all(timeline: Timeline, model: CostModel, rank: int, stages: int,
                       without: Timeline | None = None) -> float:
    """Seconds of `rank`'s step the expert all-to-all is the cause of: its own ops run
    beyond their compute (the all-to-all the simulator's lane left exposed: all of it in an
    op run alone; in an overlapped F&B pair, the part the other op's compute did not hide),
    or, when longer, the delay it adds to the rank's compute end: that end in `timeline`
    less its end in `without` (the same schedule and costs simulated with no all-to-all),
    which also counts the waits for the other ranks' all-to-alls (a rank whose stages have
    no MoE layer waits on them, and once booked that wait as bubble: issue 48)."""
    forward, backward, weight, _, _ = model.resolve(stages)
    compute = {Kind.F: forward, Kind.B: np.add(backward, weight),
               Kind.OVERLAP_B: np.add(backward, weight), Kind.I: backward, Kind.W: weight}
    rows = (timeline.rank == rank) & timeline.compute_mask()
    ran = float((timeline.end[rows] - timeline.start[rows]).sum())
    alone = 0.0
    for kind, times in compute.items():
        mine = rows & (timeline.kind == KIND_CODES[kind])
        alone += float(np.asarray(times, dtype=float)[timeline.stage[mine]].sum())
    own = max(ran - alone, 0.0)
    if without is None:
        return own
    return max(own, _compute_end(timeline, rank) - _compute_end(without, rank))


def _compute_end(timeline: Timeline, rank: int) -> float:
    rows = (timeline.rank == rank) & timeline.compute_mask()
    return float(timeline.end[rows].max()) if rows.any() else 0.0
