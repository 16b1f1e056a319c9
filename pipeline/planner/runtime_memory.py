"""Device memory a CUDA rank holds besides its tensors: cuBLAS workspaces, NCCL buffers."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.config import PlanConfig

__all__ = ["CUBLAS_HANDLES", "NCCL_CONNECTION_BYTES", "Communicator", "allocator_block_bytes",
           "allocator_segment_bytes", "cublas_workspace_bytes", "megatron_bucket_padding",
           "nccl_channels", "nccl_communicator_bytes", "nccl_p2p_channels", "nvls_bytes",
           "rank_communicators", "runtime_bytes"]

MIB = 2**20

# torch's caching allocator, c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch commit
# eb42ad6eca0ce61e7c581212b4bf32f991425571): kMinBlockSize, kSmallSize, kSmallBuffer,
# kMinLargeAlloc, kLargeBuffer, kRoundLarge.
_MIN_BLOCK = 512
_SMALL_SIZE = 1 * MIB
_SMALL_BUFFER = 2 * MIB
_MIN_LARGE_ALLOC = 10 * MIB
_LARGE_BUFFER = 20 * MIB
_ROUND_LARGE = 2 * MIB

# NCCL's per-connection buffers (NVIDIA/nccl commit 5067397c2676d5aed50042fc39e5c8ee96eb0027):
# src/init.cc DEFAULT_LL_BUFFSIZE = NCCL_LL_LINES_PER_THREAD (8) · NCCL_LL_MAX_NTHREADS (512)
# · NCCL_STEPS (8) · sizeof(ncclLLFifoLine) (16); DEFAULT_LL128_BUFFSIZE =
# NCCL_LL128_ELEMS_PER_THREAD (120) · NCCL_LL128_MAX_NTHREADS (640) · NCCL_STEPS · 8;
# DEFAULT_BUFFSIZE (Simple) 4 MiB (constants in src/include/device.h).
_NCCL_LL = 8 * 512 * 8 * 16
_NCCL_LL128 = 120 * 640 * 8 * 8
_NCCL_SIMPLE = 1 << 22
NCCL_CONNECTION_BYTES = _NCCL_LL + _NCCL_LL128 + _NCCL_SIMPLE
"""Device bytes of one NCCL connection, one channel to one peer: the three protocols'
buffers (src/transport/p2p.cc `p2pRecvSetup` sums `buffSizes` over the protocols on the
receiving side; under P2P read the Simple buffer sits with the sender instead, the same
total per pair): 512 KiB + 4.6875 MiB + 4 MiB = 9.1875 MiB."""

_MAX_CHANNELS = 64
"""MAXCHANNELS (src/include/device.h)."""
_NVLS_CHANNELS_SM90 = 16
_NVLS_CHUNK = 128 * 1024
"""NVLS_NCHANNELS_SM90 and NCCL_NVLS_CHUNKSIZE's default (src/transport/nvls.cc)."""
_NET_BYTES_PER_CHANNEL = 14e9
"""NCCL_P2P_PER_CHANNEL_NET_BW, 14 GB/s (src/graph/paths.cc)."""

CUBLAS_HANDLES = 2
"""(cuBLAS handle, stream) pairs a training rank uses: torch keys its workspaces by handle and
stream, and hands each thread its own handle (`getCurrentCUDABlasHandle`'s thread-local pool
window), so the forward's thread and autograd's device thread hold one workspace each."""


def allocator_block_bytes(size: int) -> int:
    """Bytes torch's caching allocator sets aside for a request of `size` bytes: at least
    512, rounded up to a multiple of 512 (`round_size`, without roundup_power2_divisions)."""
    _check_size(size)
    return _MIN_BLOCK if size < _MIN_BLOCK else _MIN_BLOCK * math.ceil(size / _MIN_BLOCK)


def allocator_segment_bytes(size: int) -> int:
    """Bytes the allocator asks cudaMalloc for when no cached block fits a request of `size`
    (`get_allocation_size`): a 2 MiB segment for requests up to 1 MiB, a 20 MiB one below
    10 MiB, else the request rounded up to 2 MiB. What a segment holds beyond its first block
    serves later requests of the same stream: reserved, not lost."""
    _check_size(size)
    if size <= _SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return _ROUND_LARGE * math.ceil(size / _ROUND_LARGE)


def cublas_workspace_bytes(compute_capability: int) -> int:
    """torch's cuBLAS workspace per (handle, stream), without CUBLAS_WORKSPACE_CONFIG
    (aten/src/ATen/cuda/CublasHandlePool.cpp, `parseChosenWorkspaceSize`, pytorch/pytorch
    commit 26a39059ec580351411f180816c47e2ef5134ae1): ":4096:2:16:8" (2 × 4 MiB + 8 × 16
    KiB) before Hopper, 32 MiB on sm90; cuBLASLt shares it (TORCH_CUBLASLT_UNIFIED_WORKSPACE
    on by default outside fbcode). `compute_capability`: major × 10 + minor (80, 90)."""
    if isinstance(compute_capability, bool) or not isinstance(compute_capability, int) \
            or compute_capability < 10:
        raise ValueError(f"compute_capability={compute_capability!r} must be a CUDA compute "
                         f"capability as major × 10 + minor, such as 80 or 90")
    if compute_capability == 90:
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class Communicator:
    """An NCCL communicator a rank uses: its ranks, how far apart in rank order its members
    lie at most (`span`, as `ClusterSpec.link` reads it), and the peers this rank exchanges
    with on each channel (a ring: 1, receiving from one and sending to the other;
    point-to-point, `p2p`: each peer it sends to and receives from)."""

    name: str
    size: int
    span: int
    peers: int
    p2p: bool = False


def _peer_channels(cluster: ClusterSpec, *, inside_node: bool) -> int:
    """Channels NCCL would open to one peer (src/graph/paths.cc, `ncclTopoGetNchannels`):
    over NVLink 2 × the path's bandwidth / one link's, which through an NVSwitch is 2 × the
    GPU's NVLink links (A100 12: 24; H100 18: 36); over PCIe 2; over the network at least
    one per NIC, more to reach the NIC's bandwidth at 14 GB/s a channel (a 200 Gb/s NIC 2,
    a 400 Gb/s one 4)."""
    if inside_node:
        return 2 * max(1, cluster.nvlink_links)
    nics = max(1, cluster.nics_per_node // cluster.devices_per_node)
    bandwidth = cluster.nic_bandwidth or cluster.inter_bandwidth
    return max(nics, math.ceil(bandwidth / _NET_BYTES_PER_CHANNEL))


def nccl_channels(cluster: ClusterSpec, *, inside_node: bool) -> int:
    """A ring collective's channels: the per-peer count (`_peer_channels`), at most the 32
    the ring search may find (src/init.cc: `ringGraph->maxChannels = MAXCHANNELS / 2`;
    the search itself, at init, may settle on fewer)."""
    return min(_MAX_CHANNELS // 2, _peer_channels(cluster, inside_node=inside_node))


def _power_of_two_up(value: int) -> int:
    return 1 << (value - 1).bit_length()


def nccl_p2p_channels(cluster: ClusterSpec, *, inside_node: bool) -> int:
    """Channels NCCL connects to each peer of a send / receive (src/graph/paths.cc,
    `ncclTopoComputeP2pChannels`): the fewest per-peer channels to any peer of the
    communicator (the network's where it spans nodes) rounded up to a power of two, at most
    the ring's channels rounded up likewise; src/enqueue.cc connects that many per peer at
    the first send or receive (A100, H100 in a node: 32; A800: 16)."""
    return min(_power_of_two_up(_peer_channels(cluster, inside_node=inside_node)),
               _power_of_two_up(nccl_channels(cluster, inside_node=inside_node)))


def nccl_communicator_bytes(communicator: Communicator, cluster: ClusterSpec) -> int:
    """Device bytes of one rank's connections in `communicator`: channels × peers × the
    three protocols' buffers (`NCCL_CONNECTION_BYTES`); none for a group of one."""
    if communicator.size <= 1 or communicator.peers <= 0:
        return 0
    inside = communicator.span <= cluster.devices_per_node
    channels = nccl_p2p_channels(cluster, inside_node=inside) if communicator.p2p \
        else nccl_channels(cluster, inside_node=inside)
    return channels * communicator.peers * NCCL_CONNECTION_BYTES


def nvls_bytes(communicator: Communicator, cluster: ClusterSpec) -> int:
    """Device bytes of NCCL's NVLink SHARP buffers for a collective group inside one node
    of an NVSwitch system on Hopper (compute capability 9.0 and NVLink links given; the
    multicast the switch needs is not on the A100s): src/transport/nvls.cc
    `ncclNvlsBufferSetup`, nvlsChannels (16 on sm90) × 2 × the chunk (128 KiB) × NCCL_STEPS
    per head, one head per local rank: 32 MiB × the group's size. Rounded up by the driver
    to its multicast granularity, which the source does not fix (not priced); NVLS across
    nodes (NVLS tree) is not priced either."""
    if (communicator.p2p or communicator.size <= 1 or cluster.compute_capability != 90
            or not cluster.nvlink_links or communicator.span > cluster.devices_per_node):
        return 0
    return _NVLS_CHANNELS_SM90 * 2 * _NVLS_CHUNK * 8 * communicator.size


def rank_communicators(config: PlanConfig, placement: Sequence[int],
                       tied_ranks: Sequence[int] = ()) -> list[list[Communicator]]:
    """Per pipeline rank, the communicators it sends through (ranks ordered tp innermost,
    then cp, then dp, then pp): tp, cp and the gradients' dp × cp group as rings; the expert
    all-to-all over ep (a peer each); the pipeline's neighbours by the schedule's
    `placement` (a peer each, point-to-point); the tied embeddings' group of the ranks in
    `tied_ranks`. NCCL connects a communicator's buffers at its first use
    (NCCL_RUNTIME_CONNECT, on by default), so groups never used hold nothing."""
    tp, cp, dp, pp = config.tp, config.cp, config.dp, config.pp
    common = [Communicator("tp", tp, tp, 1), Communicator("cp", cp, (cp - 1) * tp + 1, 1),
              Communicator("dp", dp * cp, (dp * cp - 1) * tp + 1, 1),
              Communicator("ep", config.ep, (config.ep - 1) * cp * tp + 1, config.ep - 1,
                           p2p=True)]
    stride = dp * cp * tp
    neighbours: list[set[int]] = [set() for _ in range(pp)]
    for first, second in itertools.pairwise(placement):
        if first != second:
            neighbours[first].add(second)
            neighbours[second].add(first)
    tied = sorted(set(tied_ranks))
    ranks = []
    for rank in range(pp):
        mine = list(common)
        if neighbours[rank]:  # the pp group's channels per peer: its farthest members'
            mine.append(Communicator("pp", pp, (pp - 1) * stride + 1, len(neighbours[rank]),
                                     p2p=True))
        if len(tied) > 1 and rank in tied:
            mine.append(Communicator("tied", len(tied), (tied[-1] - tied[0]) * stride + 1, 1))
        ranks.append(mine)
    return ranks


def runtime_bytes(cluster: ClusterSpec, config: PlanConfig, placement: Sequence[int],
                  tied_ranks: Sequence[int] = ()) -> np.ndarray:
    """Per pipeline rank, device bytes the runtime holds besides the tensors priced
    elsewhere: torch's cuBLAS workspaces (`CUBLAS_HANDLES` of `cublas_workspace_bytes`, as
    the allocator's blocks), NCCL's buffers of each communicator it uses (with NVLS's on
    Hopper, `nvls_bytes`), and the cluster's
    `memory_margin` (the CUDA context and fragmentation, for which no source gives a
    figure). A cluster without CUDA (`compute_capability` 0, the CPU `local` one) holds the
    margin only."""
    ranks = np.full(config.pp, float(cluster.memory_margin))
    if not cluster.compute_capability:
        return ranks
    workspaces = CUBLAS_HANDLES * allocator_block_bytes(
        cublas_workspace_bytes(cluster.compute_capability))
    for rank, communicators in enumerate(rank_communicators(config, placement, tied_ranks)):
        ranks[rank] += workspaces + sum(nccl_communicator_bytes(communicator, cluster)
                                        + nvls_bytes(communicator, cluster)
                                        for communicator in communicators)
    return ranks


def megatron_bucket_padding(parameters: int, tensors: int, dp: int) -> int:
    """At most how many elements Megatron-Core's distributed optimizer pads a buffer of
    `parameters` elements in `tensors` tensors with, at data-parallel size `dp`
    (megatron/core/optimizer/param_layout.py, NVIDIA/Megatron-LM commit d98e8a64dd):
    each tensor's start to 64 elements (`pad_param_start`), each bucket's end to
    lcm(dp, 128) (`pad_bucket_end`), buckets of max(40M, 1M · dp) elements
    (distributed_data_parallel.py). A bound: a few MB at most, next to gigabytes of
    states, so the planner leaves it out."""
    for name, value in (("parameters", parameters), ("tensors", tensors), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (name != "parameters"):
            raise ValueError(f"{name}={value!r} must be a whole number >= "
                             f"{int(name != 'parameters')}")
    buckets = max(1, math.ceil(parameters / max(40_000_000, 1_000_000 * dp)))
    return tensors * 63 + buckets * (math.lcm(dp, 128) - 1)


def _check_size(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size={size!r} must be a whole number of bytes >= 0")
