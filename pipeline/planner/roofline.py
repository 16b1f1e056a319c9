"""Kernels priced by roofline: GEMMs with tile and wave quantization, element-wise by bytes."""

from __future__ import annotations

import math

from pipeline.planner.cluster import ClusterSpec

__all__ = ["TILE_ROW_GRANULE", "elementwise_seconds", "epilogue_seconds", "gemm_seconds"]

# CUTLASS/cuBLAS tile shapes for 16-bit GEMMs on Ampere/Hopper and the share of a full
# tile's throughput each reaches (smaller tiles reuse less of what they load). A GEMM takes
# the fastest: a thin or small one runs smaller tiles in fuller waves, as cuBLAS's
# heuristics do.
_TILES = ((256, 128, 1.0), (128, 256, 1.0), (128, 128, 0.93), (256, 64, 0.9), (64, 256, 0.9),
          (128, 64, 0.85), (64, 128, 0.85), (64, 64, 0.7))
TILE_ROW_GRANULE = math.gcd(*(rows for rows, _, _ in _TILES))
"""64: every tile's rows are a multiple of it, so a GEMM's tile count in m, hence its compute
time, is constant over the m in each (64·j, 64·(j + 1)]."""


def gemm_seconds(m: int, n: int, k: int, cluster: ClusterSpec, precision: str, *,
                 batch: int = 1, efficiency: float = 1.0, element: int = 2) -> float:
    """A (batched) GEMM C[m×n] = A[m×k]·B[k×n]: the slower of its tiles' compute, run in
    waves of `sm_count` tiles, and its bytes through memory (the output's after the k-loop
    where the device's kernels store it so, `epilogue_seconds`); plus one launch."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    if cluster.gemm_measurements:
        return _measured_gemm(m, n, k, cluster) * batch + cluster.kernel_overhead
    bandwidth = cluster.memory_bandwidth * cluster.memory_efficiency
    loads = batch * (m * k + k * n) * element / bandwidth
    store = epilogue_seconds(m, n, cluster, batch=batch, element=element)
    per_sm = cluster.peak_flops[precision] / cluster.sm_count * cluster.gemm_efficiency \
        * efficiency
    best = math.inf
    for rows, cols, share in _TILES:
        tiles = batch * math.ceil(m / rows) * math.ceil(n / cols)
        waves = math.ceil(tiles / cluster.sm_count)
        best = min(best, waves * 2 * rows * cols * k / (per_sm * share))
    if cluster.gemm_epilogue_serial:
        return max(best, loads) + store + cluster.kernel_overhead
    return max(best, loads + store) + cluster.kernel_overhead


def epilogue_seconds(m: int, n: int, cluster: ClusterSpec, *, batch: int = 1,
                     element: int = 2) -> float:
    """Seconds a GEMM's epilogue takes to write its m × n output (`batch` times, `element`
    bytes each) through HBM at the element-wise kernels' bandwidth.

    On a device whose kernels store each tile after its k-loop (`ClusterSpec.
    gemm_epilogue_serial`) this adds to the k-loop instead of hiding under it: Ampere's
    CUTLASS 2.x kernel (`include/cutlass/gemm/kernel/gemm.h`, NVIDIA/cutlass v2.5, 2021)
    runs the threadblock's `mma(...)` over all of k, then its `epilogue(...)`, which streams
    the accumulator tile to global memory; a 256 × 128 tile takes an SM's whole shared
    memory, one threadblock per SM, so no other tile's k-loop runs beside it. Hopper's
    warp-specialised persistent kernels (`sm90_gemm_tma_warpspecialized_pingpong.hpp`,
    CUTLASS 3; "efficient_gemm.md", Hopper warp specialisation) overlap one tile's epilogue
    with the other consumer warp group's k-loop. Its share of a GEMM is e·F/(2k·B) (F the
    SMs' FLOP/s, B bytes/s): 130/k on an A100 at 0.7225 of the fp16 peak, 5.6 % of a k = 2,304
    GEMM, 1 % at k = 12,800: thin-k GEMMs (small hidden sizes, a wide tp) lose the most."""
    return batch * m * n * element / (cluster.memory_bandwidth * cluster.memory_efficiency)


def _measured_gemm(m: int, n: int, k: int, cluster: ClusterSpec) -> float:
    """Seconds of an m × n × k GEMM at the FLOP/s of the nearest measured shape (distance in
    log space, so 4096 is as far from 2048 as 2048 from 1024)."""
    def distance(row: tuple[int, int, int, float]) -> float:
        return sum((math.log(a) - math.log(b)) ** 2 for a, b in zip((m, n, k), row[:3]))

    rm, rn, rk, seconds = min(cluster.gemm_measurements, key=distance)
    return 2 * m * n * k / (2 * rm * rn * rk / seconds)


def _stream_seconds(nbytes: float, cluster: ClusterSpec, kernels: int = 1) -> float:
    """Memory-bound element-wise kernels moving `nbytes` in all."""
    return nbytes / (cluster.memory_bandwidth * cluster.memory_efficiency) \
        + kernels * cluster.kernel_overhead


def elementwise_seconds(nbytes: float, cluster: ClusterSpec, kernels: int = 1) -> float:
    """Memory-bound element-wise kernels moving `nbytes` in all, as every layer prices them
    (the GPU check compares a measured one with it)."""
    return _stream_seconds(nbytes, cluster, kernels)
