"""Price a layer on a cluster: its kernels (`kernels`), measured times, or FLOPs at a share
of the peak; and the network model every collective is priced by: NCCL's own cost model
(`nccl_model`) on a cluster with `nccl_arch`, else α–β per hop, ring or tree, NVLink inside
a node, the network cards between nodes."""

from __future__ import annotations

import math

from pipeline.planner import nccl_model
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.expert_kernels import block_kernel_times, gathered_rows
from pipeline.planner.host_launch import host_pass_seconds, issue_bound_seconds
from pipeline.planner.kernels import attention_core_seconds, block_linear_times
from pipeline.planner.profile import LayerProfile
from pipeline.planner.userbuffers import sm_contention_seconds, userbuffers_sms
from schedules.analysis.tp_overlap import ParallelLinearCosts, linears_exposed

__all__ = ["TP_OVERLAPS", "allgather_seconds", "allreduce_seconds", "expert_tp_seconds",
           "layer_selective_seconds",
           "layer_split_times", "layer_times", "layer_tp_pass_seconds", "layer_tp_seconds",
           "p2p_link", "p2p_seconds", "reduce_scatter_seconds", "ring_allreduce_seconds",
           "tree_allreduce_seconds"]


def ring_allreduce_seconds(nbytes: float, group: int, bandwidth: float, latency: float
                           ) -> float:
    """A ring all-reduce: 2(d-1)/d of the bytes through each link, 2(d-1) latency hops
    (Patarasuk & Yuan 2009; the same volume as reduce-scatter + all-gather, ZeRO-1's pair)."""
    if group <= 1:
        return 0.0
    return 2 * (group - 1) / group * nbytes / bandwidth + 2 * (group - 1) * latency


def tree_allreduce_seconds(nbytes: float, group: int, bandwidth: float, latency: float
                           ) -> float:
    """A pipelined (double binary) tree all-reduce, as NCCL runs it between nodes: reduce
    up and broadcast down, 2·log2(d) latency hops, every byte once each way (Sanders et al.
    2009, "Two-tree algorithms for full bandwidth broadcast, reduction and scan")."""
    if group <= 1:
        return 0.0
    return 2 * nbytes / bandwidth + 2 * math.ceil(math.log2(group)) * latency


def allreduce_seconds(nbytes: float, group: int, stride: int, cluster: ClusterSpec) -> float:
    """An all-reduce of `nbytes` over `group` ranks `stride` apart in the rank order.

    With `nccl_arch`: what NCCL's tuner predicts for the algorithm and protocol it picks
    (`nccl_model.choose`), over the g members a node holds and the nodes, on the node's NIC
    share of those g ranks. Otherwise α–β: inside a node, the faster of ring and tree over
    NVLink; across nodes, hierarchically: reduce-scatter among the g members a node holds,
    all-reduce 1/g of the bytes between the nodes (ring or tree, whichever is faster at
    this size), all-gather inside again."""
    if group <= 1:
        return 0.0
    if cluster.nccl_arch:
        local, _ = nccl_model.communicator(group, stride, cluster.devices_per_node)
        return nccl_model.choose("allreduce", nbytes, group, local, cluster).seconds
    if group * stride <= cluster.devices_per_node:
        bandwidth, latency = cluster.link(group * stride)
        return min(ring_allreduce_seconds(nbytes, group, bandwidth, latency),
                   tree_allreduce_seconds(nbytes, group, bandwidth, latency))
    local = max(1, min(group, cluster.devices_per_node // stride))
    nodes = math.ceil(group / local)
    intra_bw, intra_lat = cluster.link(1)
    inter_bw, inter_lat = cluster.link(cluster.devices_per_node + 1)
    inside = ring_allreduce_seconds(nbytes, local, intra_bw, intra_lat)
    between = min(ring_allreduce_seconds(nbytes / local, nodes, inter_bw, inter_lat),
                  tree_allreduce_seconds(nbytes / local, nodes, inter_bw, inter_lat))
    return inside + between


def _half_allreduce(collective: str, nbytes: float, group: int, stride: int,
                    cluster: ClusterSpec) -> float:
    if group <= 1:
        return 0.0
    if cluster.nccl_arch:
        local, _ = nccl_model.communicator(group, stride, cluster.devices_per_node)
        return nccl_model.choose(collective, nbytes, group, local, cluster).seconds
    return allreduce_seconds(nbytes, group, stride, cluster) / 2


def reduce_scatter_seconds(nbytes: float, group: int, stride: int, cluster: ClusterSpec
                           ) -> float:
    """A reduce-scatter of `nbytes` (the whole buffer, each rank keeping 1/group) over
    `group` ranks `stride` apart: NCCL's pick with `nccl_arch` (ring, or PAT with one rank a
    node), else half an all-reduce's α–β time (the same bytes on the wire)."""
    return _half_allreduce("reducescatter", nbytes, group, stride, cluster)


def allgather_seconds(nbytes: float, group: int, stride: int, cluster: ClusterSpec) -> float:
    """An all-gather whose whole result is `nbytes` over `group` ranks `stride` apart, as
    `reduce_scatter_seconds` prices it."""
    return _half_allreduce("allgather", nbytes, group, stride, cluster)


def p2p_link(cluster: ClusterSpec, span: int, nbytes: float = float("inf")
             ) -> tuple[float, float]:
    """(bytes/s, seconds) of a message between ranks `span` apart: NCCL's ring hop with
    `nccl_arch` (`nccl_model.p2p_link`, its protocol by `nbytes`), else the link at
    `link_efficiency`."""
    if cluster.nccl_arch:
        return nccl_model.p2p_link(cluster, span, nbytes)
    return cluster.link(span)


def p2p_seconds(nbytes: float, span: int, cluster: ClusterSpec) -> float:
    """One message between ranks `span` apart: α + n/β (`p2p_link`)."""
    bandwidth, latency = p2p_link(cluster, span, nbytes)
    return latency + nbytes / bandwidth


def _kernel_model(layer: LayerProfile, cluster: ClusterSpec) -> bool:
    return layer.shape is not None and (cluster.sm_count > 0 or bool(cluster.gemm_measurements))


def layer_tp_seconds(layer: LayerProfile, cluster: ClusterSpec, batch: int, tp: int
                     ) -> float:
    """Seconds of one pass's tensor-parallel collectives (Megatron: as many in the forward
    as in the backward). With sequence parallelism each all-reduce is a reduce-scatter and
    an all-gather: the same bytes on the wire (Korthikanti et al. 2022, section 4.2.2)."""
    if tp <= 1 or not layer.tp_allreduces:
        return 0.0
    return layer.tp_allreduces * allreduce_seconds(layer.tp_allreduce_bytes * batch, tp, 1,
                                                   cluster)


TP_OVERLAPS = ("none", "megatron-core", "pipesched")
"""How an engine hides its tensor-parallel collectives behind GEMMs
(`layer_tp_pass_seconds`): none (every collective exposed: this engine's default,
Megatron-LM 2021, DeepSpeed), megatron-core (--tp-comm-overlap), pipesched (this engine's
overlapped layers, `ParallelTransformerBlock(overlap=True)`; `pipesched plan
--tp-comm-overlap`)."""


def _ring_exchange(gemm: float, collective: float, tp: int) -> float:
    """Exposed seconds of an all-gather (or reduce-scatter) of `collective` seconds run as
    Transformer Engine's ring exchange beside a GEMM of `gemm` seconds: t GEMM slices, the
    first on the rank's own shard at once, each of the t - 1 point-to-point steps
    (collective / (t - 1) each) beside the slice before it; a step longer than a slice is
    exposed by the difference."""
    step, piece = collective / (tp - 1), gemm / tp
    return (tp - 1) * max(0.0, step - piece)


def _pipesched_exposed(layer: LayerProfile, cluster: ClusterSpec, precision: str, batch: int,
                       tp: int) -> tuple[float, float]:
    """This engine's overlapped block (`pipeline.parallel.tensor.overlap`) by its rule,
    `schedules.analysis.tp_overlap`, over the block's linears (`kernels.block_linear_times`):
    each all-reduce (or, with sequence parallelism, each all-gather / reduce-scatter: half
    its bytes) priced by the network model, whole and in `tp_overlap_chunks` slices."""
    shape = layer.shape
    assert shape is not None
    chunks, halves = shape.tp_overlap_chunks, 2 if shape.sequence_parallel else 1
    nbytes = layer.tp_allreduce_bytes * batch
    collective = allreduce_seconds(nbytes, tp, 1, cluster) / halves
    chunk = allreduce_seconds(nbytes / chunks, tp, 1, cluster) / halves
    linears = [ParallelLinearCosts(kind, *times, collective=collective, chunk_collective=chunk)
               for kind, times in block_linear_times(shape, batch, tp, cluster, precision)]
    return linears_exposed(linears, sequence_parallel=shape.sequence_parallel, overlap=True,
                           chunks=chunks)


def expert_tp_seconds(layer: LayerProfile, cluster: ClusterSpec, batch: int, tp: int
                      ) -> tuple[float, float]:
    """(forward, backward) seconds of a MoE block's expert-tensor-parallel collectives in one
    microbatch (`pipeline.moe.expert_tensor_parallel`; (0, 0) at expert tp 1 or without a
    kernel model): the forward all-gathers the tp group's routed rows (a whole result of G
    rows of h·e bytes, `expert_kernels.gathered_rows`, after an all-gather of the t ranks'
    per-expert row counts, 8 bytes each) and reduce-scatters the partial outputs of those G
    rows back to their owners; the backward runs each one's adjoint (the gather's a
    reduce-scatter, the reduce-scatter's an all-gather), over the t ranks of the tp group,
    neighbours, not overlapped (the engine runs them between its GEMMs). At cp > 1, × cp as
    `expert_kernels.moe_mlp_times` (the stage table divides every layer by cp)."""
    shape = layer.shape
    if shape is None or shape.role != "block" or shape.routed is None \
            or shape.routed.expert_tp == 1 or not _kernel_model(layer, cluster):
        return 0.0, 0.0
    routed, t = shape.routed, shape.routed.expert_tp
    nbytes = gathered_rows(shape, batch, tp) * shape.hidden * shape.element
    pair = allgather_seconds(nbytes, t, 1, cluster) + reduce_scatter_seconds(
        nbytes, t, 1, cluster)
    counts = allgather_seconds(8.0 * routed.local_experts * t, t, 1, cluster)
    return routed.cp * (pair + counts), routed.cp * pair


def layer_tp_pass_seconds(layer: LayerProfile, cluster: ClusterSpec, precision: str,
                          batch: int, tp: int, overlap: str = "none") -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch's tensor-parallel collectives left
    exposed by the engine's `overlap` rule (`TP_OVERLAPS`), the one place the planner
    prices it: the block's (`_block_tp_pass_seconds`) and, at expert tensor parallelism
    t > 1, its experts' (`expert_tp_seconds`), exposed under every rule."""
    forward, backward = _block_tp_pass_seconds(layer, cluster, precision, batch, tp, overlap)
    experts = expert_tp_seconds(layer, cluster, batch, tp)
    return forward + experts[0], backward + experts[1]


def _block_tp_pass_seconds(layer: LayerProfile, cluster: ClusterSpec, precision: str,
                           batch: int, tp: int, overlap: str = "none") -> tuple[float, float]:
    """The block's tensor-parallel collectives, exposed by the `overlap` rule.

    none: all of them (`layer_tp_seconds`, each pass; under sequence parallelism the backward
    also re-gathers the two column-parallel linears' inputs for their weight gradients,
    Megatron's `LinearWithGradAccumulationAndAsyncCommunication` and this engine's
    sequence-parallel layers: 1.5×, what `schedules.analysis.tp_overlap` gives without
    overlap). pipesched: this engine's overlapped layers, with or without sequence
    parallelism, on a block with a shape on the kernel model (`_pipesched_exposed`): a
    column layer's reduction beside its weight-gradient GEMM (and its input's re-gather
    beside the input-gradient GEMM), the other collectives pipelined in
    `tp_overlap_chunks` slices against their GEMMs. megatron-core:
    Megatron-Core's
    --tp-comm-overlap (Transformer Engine's userbuffers; it requires sequence parallelism,
    `arguments.py`: "Tensor parallel communication/GEMM overlap can happen only when
    sequence parallelism is enabled"), on a block with a shape on the kernel model: every
    all-gather / reduce-scatter (half an all-reduce's bytes) of the forward in t - 1 steps
    against its linear's GEMM in t slices (`_ring_exchange`); backward, a
    column-parallel linear's input re-gather beside its input-gradient GEMM and the input
    gradient's reduce-scatter beside its weight-gradient GEMM (bulk overlap: max(0, q - g)
    each), a row-parallel linear's output-gradient gather pipelined against its input-
    gradient GEMM; each GEMM beside a "pipeline" or "bulk" overlap slowed by the SMs its
    communication kernel holds (`userbuffers`: Transformer Engine's SM counts in NeMo's H100
    recipe). Elsewhere (embedding, head, no sequence parallelism for megatron-core):
    exposed whole."""
    if overlap not in TP_OVERLAPS:
        raise ValueError(f"tp overlap {overlap!r} must be one of {', '.join(TP_OVERLAPS)}")
    whole = layer_tp_seconds(layer, cluster, batch, tp)
    shape = layer.shape
    if not whole or shape is None or shape.role != "block" \
            or not _kernel_model(layer, cluster):
        return whole, whole
    if overlap == "pipesched":
        return _pipesched_exposed(layer, cluster, precision, batch, tp)
    if not shape.sequence_parallel:
        return whole, whole
    if overlap == "none":  # the backward re-gathers each column-parallel linear's input
        return whole, 1.5 * whole
    collective = allreduce_seconds(layer.tp_allreduce_bytes * batch, tp, 1, cluster) / 2
    forward = backward = 0.0
    for index, (kind, (gemm, input_grad, weight_grad)) in enumerate(
            block_linear_times(shape, batch, tp, cluster, precision)):
        # the SMs userbuffers' kernels take from the GEMMs they run beside
        sms = userbuffers_sms(index)
        forward += sm_contention_seconds(gemm, cluster.sm_count, sms[0])
        backward += (sm_contention_seconds(input_grad, cluster.sm_count, sms[1])
                     + sm_contention_seconds(weight_grad, cluster.sm_count, sms[2]))
        forward += _ring_exchange(gemm, collective, tp)
        if kind == "column":
            backward += max(0.0, collective - input_grad) + max(0.0, collective - weight_grad)
        else:
            backward += _ring_exchange(input_grad, collective, tp)
    return forward, backward


def layer_times(layer: LayerProfile, cluster: ClusterSpec, precision: str, batch: int,
                tp: int, overlap: str = "none") -> tuple[float, float]:
    """(forward, full backward) seconds of one microbatch of `batch` samples on one tp
    rank, tensor-parallel collectives included.

    A layer with a shape, on a cluster with a device model: its kernels, each pass the
    longer of their device time and the host's time to issue them (`host_launch`; the
    backward one pass). Measured layers: their fixed + per-sample times. Otherwise its FLOPs
    at `achieved_fraction` of the peak, backward = 2 × forward (Narayanan et al. 2021,
    section 5.1). The collectives exposed by the engine's `overlap` rule
    (`layer_tp_pass_seconds`)."""
    comm = layer_tp_seconds(layer, cluster, batch, tp)
    if _kernel_model(layer, cluster):
        assert layer.shape is not None
        kernels = block_kernel_times(layer.shape, batch, tp, cluster, precision)
        host = host_pass_seconds(layer, batch, tp, cluster, precision, kernels)
        forward_comm, backward_comm = layer_tp_pass_seconds(layer, cluster, precision, batch,
                                                            tp, overlap)
        return (issue_bound_seconds(kernels.forward, host.forward) + forward_comm,
                issue_bound_seconds(kernels.input_grad + kernels.weight_grad,
                                    host.input_grad + host.weight_grad) + backward_comm)
    if layer.forward_seconds is not None:
        forward = layer.forward_fixed + layer.forward_seconds * batch
        backward = layer.backward_fixed + (layer.backward_seconds or 0.0) * batch
    else:
        rate = cluster.flops(precision)
        work = (layer.flops_split / tp + layer.flops_replicated) * batch / rate
        forward, backward = work, 2 * work
    return forward + comm, backward + comm


def layer_split_times(layer: LayerProfile, cluster: ClusterSpec, precision: str, batch: int,
                      tp: int, overlap: str = "none") -> tuple[float, float]:
    """(I, W) seconds of a split backward of one microbatch, the tensor-parallel collectives
    in I: the kernel model's own halves (each the longer of its device and host time,
    `host_launch`); measured ones when profiled (an engine's W may cost more than half a
    backward); else half the backward's work each."""
    comm = layer_tp_seconds(layer, cluster, batch, tp)
    if _kernel_model(layer, cluster):
        assert layer.shape is not None
        kernels = block_kernel_times(layer.shape, batch, tp, cluster, precision)
        host = host_pass_seconds(layer, batch, tp, cluster, precision, kernels)
        _, backward_comm = layer_tp_pass_seconds(layer, cluster, precision, batch, tp, overlap)
        return (issue_bound_seconds(kernels.input_grad, host.input_grad) + backward_comm,
                issue_bound_seconds(kernels.weight_grad, host.weight_grad))
    if layer.split_seconds is None:
        _, backward = layer_times(layer, cluster, precision, batch, tp)
        return comm + (backward - comm) / 2, (backward - comm) / 2
    return (layer.split_fixed[0] + layer.split_seconds[0] * batch,
            layer.split_fixed[1] + layer.split_seconds[1] * batch)


def layer_selective_seconds(layer: LayerProfile, cluster: ClusterSpec, precision: str,
                            batch: int, tp: int) -> float:
    """Seconds selective recomputation adds to one microbatch's backward: attention's core
    forward again (Korthikanti et al. 2022, section 4.1). The kernel model's attention
    kernels; otherwise `selective_flops_split` as a share of the layer's forward."""
    if not layer.selective_flops_split:
        return 0.0
    if _kernel_model(layer, cluster):
        assert layer.shape is not None
        return attention_core_seconds(layer.shape, batch, tp, cluster, precision)
    forward, _ = layer_times(layer, cluster, precision, batch, tp)
    forward -= layer_tp_pass_seconds(layer, cluster, precision, batch, tp)[0]
    share = layer.selective_flops_split / tp / max(
        layer.flops_split / tp + layer.flops_replicated, layer.selective_flops_split / tp)
    return forward * share
