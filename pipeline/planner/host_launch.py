"""The host side of a layer pass: the ops its CPU thread issues, counted from the kernel model
that prices the pass, at `ClusterSpec.host_op_seconds` each; the pass takes the longer of its
device and host time (`issue_bound_seconds`)."""

from __future__ import annotations

from dataclasses import replace

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.expert_kernels import block_kernel_times
from pipeline.planner.kernels import KernelTimes, LayerShape
from pipeline.planner.profile import LayerProfile

__all__ = ["HOST_OP_SECONDS", "host_pass_seconds", "issue_bound_seconds", "pass_collective_calls",
           "pass_kernel_counts"]

HOST_OP_SECONDS = 10e-6
"""Host seconds to issue one op of an eager PyTorch training step (Python, the dispatcher,
autograd's recording or its engine's node, the CUDA launch), the presets' figure: the middle
(geometric, √(5 · 20)) of the 5–20 µs "launch time on the CPU side" per GPU kernel that Meta's
Holistic Trace Analysis reports usual in PyTorch traces (facebookresearch/HolisticTraceAnalysis,
`docs/source/features/cuda_kernel_launch_stats.rst`: "Usually, the launch time on the CPU side
is between 5-20 microseconds. In some cases the GPU execution time is lower than the launch
time itself"); NVIDIA's CUDA Graph best-practice guide (docs.nvidia.com/dl-cuda-graph, "CUDA
Graph Basics") names the same cost, each launch paid on the CPU, the GPU idle where its
kernels are shorter. A device profile measures the machine's own (`calibrate.
host_op_seconds`)."""

_PROBE = 1.0
"""Seconds added to `kernel_overhead` to count the kernels that pay it (`pass_kernel_counts`)."""


def pass_kernel_counts(shape: LayerShape, batch: int, tp: int, cluster: ClusterSpec,
                       precision: str, device: KernelTimes | None = None) -> KernelTimes:
    """Kernels one microbatch of `batch` samples launches through `shape` on one of `tp`
    ranks, per pass (forward, input gradient, weight gradient), counted where the kernel model
    prices them: every kernel `kernels` and `expert_kernels` price pays `ClusterSpec.
    kernel_overhead` once and nothing else depends on it, so a pass's count is how much its
    seconds rise per second added to that cost. It counts what the model prices: a norm's
    backward, priced 1.5 forward passes, counts 1.5 kernels, FlashAttention's backward 2.5
    (it recomputes QKᵀ), a MoE block one GEMM per local expert. `device`: the pass times at
    `cluster` already priced (`expert_kernels.block_kernel_times`)."""
    base = device or block_kernel_times(shape, batch, tp, cluster, precision)
    probe = block_kernel_times(
        shape, batch, tp, replace(cluster, kernel_overhead=cluster.kernel_overhead + _PROBE),
        precision)
    # the rise is an exact multiple of _PROBE but for rounding in the sums: 6 decimals keep
    # the model's half kernels and drop the noise
    return KernelTimes(*(round((getattr(probe, name) - getattr(base, name)) / _PROBE, 6)
                         for name in ("forward", "input_grad", "weight_grad")))


def pass_collective_calls(layer: LayerProfile, tp: int) -> tuple[float, float]:
    """(forward, backward) communication calls one tp rank issues per pass of `layer`: each
    tensor-parallel all-reduce one call (`LayerProfile.tp_allreduces`), under sequence
    parallelism a reduce-scatter and an all-gather, the backward also re-gathering the two
    column-parallel inputs (1.5×, as `pricing.layer_tp_pass_seconds` prices their bytes); a
    MoE block across ep ranks its dispatch and combine all-to-alls each pass, at expert
    tensor parallelism t > 1 also the tp group's gathers (forward: the row counts and the
    rows, and the partial outputs' reduce-scatter; backward: their two adjoints)."""
    shape = layer.shape
    collectives = float(layer.tp_allreduces) if tp > 1 else 0.0
    sequence_parallel = shape is not None and shape.sequence_parallel
    forward = collectives * (2 if sequence_parallel else 1)
    backward = forward * (1.5 if sequence_parallel else 1)
    routed = shape.routed if shape is not None else None
    if routed is not None:
        # a cp rank's own calls × cp: the stage table divides every layer by cp
        exchanges = 2 if routed.ep > 1 else 0
        if routed.expert_tp > 1:  # the row counts' and rows' gathers, the reduce-scatter
            forward, backward = forward + 3 * routed.cp, backward + 2 * routed.cp
        forward, backward = forward + exchanges * routed.cp, backward + exchanges * routed.cp
    return forward, backward


def host_pass_seconds(layer: LayerProfile, batch: int, tp: int, cluster: ClusterSpec,
                      precision: str, device: KernelTimes | None = None) -> KernelTimes:
    """Host seconds to issue one microbatch's passes of `layer` on one tp rank (forward, input
    gradient, weight gradient): its kernels (`pass_kernel_counts`; each launched by one
    dispatcher call, the backward's by the autograd node that runs them) and communication
    calls (`pass_collective_calls`, with the input gradient) at `host_op_seconds` each.
    Zero when the cluster sets no host cost or the layer has no kernel shape (measured
    layers' times already hold their host time)."""
    if not cluster.host_op_seconds or layer.shape is None:
        return KernelTimes(0.0, 0.0, 0.0)
    kernels = pass_kernel_counts(layer.shape, batch, tp, cluster, precision, device)
    forward_calls, backward_calls = pass_collective_calls(layer, tp)
    op = cluster.host_op_seconds
    return KernelTimes((kernels.forward + forward_calls) * op,
                       (kernels.input_grad + backward_calls) * op, kernels.weight_grad * op)


def issue_bound_seconds(device: float, host: float) -> float:
    """Seconds of a pass whose ops the host issues asynchronously: the GPU runs each kernel
    once it is queued and the host runs ahead of it, so the longer of the two sets the pace
    (the queue hides the shorter; a device behind its host never waits, a host behind its
    device starves it: the regime CUDA Graphs remove, docs.nvidia.com/dl-cuda-graph)."""
    return max(device, host)
