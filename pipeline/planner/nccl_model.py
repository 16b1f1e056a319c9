"""NCCL's own cost model of a collective: the algorithm and protocol its tuner predicts fastest."""

# Read from NVIDIA/nccl at 5067397c2676d5aed50042fc39e5c8ee96eb0027 (2026-06-11):
# src/graph/tuning.cc (`ncclTunerConstantsDefaults`, `ncclTopoTuneModel`,
# `treeCorrectionFactor`, `ncclTopoGetAlgoTime`), src/graph/search.cc (the speed arrays,
# `ncclTopoDupChannels`), src/graph/topo.h (`SM80_NVLINK_BW`, `SM90_NVLINK_BW`) and
# src/enqueue.cc (`NCCL_P2P_LL_THRESHOLD`). NCCL's times are µs and its bandwidths GB/s
# (bytes / (1000 · GB/s) = µs); so are the tables here.
#
# What NCCL computes from the machine and this model assumes instead (one DGX-like node of
# NVSwitch-connected GPUs, one NIC per GPU or a share of the node's NICs):
# - the ring/tree graph search (`ncclTopoCompute`) is not run. Its outcome is taken as the
#   architecture's fastest channel speed (speed array) not above the bottleneck link, as
#   many channels as that link holds, then `ncclTopoDupChannels`: inside a node the link is
#   the GPU's NVLinks at NCCL's rating (`nvlink_links`, else `intra_bandwidth` / 25 GB/s a
#   link, × 20.0 or 20.6);
#   across nodes each channel leaves through one NIC at the speed below the NIC's, and a
#   communicator with `local` ranks on a node has their NIC share (`device_inter_bandwidth`
#   each): rail-aligned rings, as NCCL builds them on one NIC per GPU. The tree graph has
#   the ring's channels, a balanced tree (no 0.85 `NCCL_TOPO_PATTERN_TREE` penalty);
# - the host CPU is x86 Intel: `getNetOverhead` 1 µs and the multi-node `llMaxBws` row
#   (DGX A100's AMD EPYC would give 2 µs and the AMD row); the IB plugin's
#   `props->latency = 0` (no `latencyInter`); LL128 enabled (NICs on the GPUs' PCIe
#   switches, PATH_PXB); NVLS, CollNet and NCCL_ALGO/NCCL_PROTO overrides: not modelled.
# Send/receive has no tuning table in NCCL; `p2p_link` prices it as one hop of the ring
# (base + one hop's hardware latency, the link's channels), LL for a message of at most
# `P2P_LL_THRESHOLD` bytes a channel (enqueue.cc), Simple above.

from __future__ import annotations

import math
from typing import NamedTuple

from pipeline.planner.cluster import NCCL_ARCHS, ClusterSpec

__all__ = ["BASE_LATENCY", "HW_LATENCY", "LL_MAX_BW", "NCCL_COMMIT", "NVLINK_LINK_GBPS",
           "PROTOCOLS", "SPEEDS_INTER", "SPEEDS_INTRA", "TREE_CORRECTION", "Channels",
           "Choice", "bandwidth", "channels", "choose", "communicator", "latency",
           "p2p_link", "predicted_seconds"]

NCCL_COMMIT = "5067397c2676d5aed50042fc39e5c8ee96eb0027"
PROTOCOLS = ("LL", "LL128", "Simple")
LL, LL128, SIMPLE = 0, 1, 2
COLLECTIVES = ("allreduce", "reducescatter", "allgather")

# tuning.cc, ncclTunerConstantsDefaults: µs per (LL, LL128, Simple)
BASE_LATENCY = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "pat": (8.0, 8.0, 8.0)}
HW_LATENCY = {  # NCCL_HW_NVLINK, NCCL_HW_NET
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "pat": (0.0, 0.0, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "pat": (0.0, 0.0, 14.0)},
}
# llMaxBws rows (by nodes: 1, 2, >2): a single node reads its GPU's row, more nodes the CPU's
LL_MAX_BW = {"ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0),
             "intel": (39.0, 39.0, 20.4)}
RING_LL128_BW = {"ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 36.7)}  # per channel
TREE_LL128_BW = {"ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 29.0)}
TREE_BW = {"ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0)}
TREE_CORRECTION = (  # treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B to 256 MiB
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
     1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9,
     1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9,
     .9, .9))
NET_OVERHEAD_US = 1.0  # getNetOverhead, x86 Intel; tripled for Simple
RING_PLATEAU = 1.4  # ncclTopoGetAlgoTime: multi-node ring Simple all-reduce, compute cap >= 80
# search.cc speed arrays (GB/s a channel) and topo.h NVLink ratings (GB/s a link)
SPEEDS_INTRA = {"ampere": (40.0, 30.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0, 6.0, 5.0, 4.0,
                           3.0),
                "hopper": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0)}
SPEEDS_INTER = {"ampere": (48.0, 30.0, 28.0, 24.0, 20.0, 18.0, 15.0, 12.0, 10.0, 9.0, 7.0,
                           6.0, 5.0, 4.0, 3.0, 2.4, 1.2, 0.24, 0.12),
                "hopper": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0,
                           6.0, 3.0, 2.4, 1.2, 0.24, 0.12)}
NVLINK_LINK_GBPS = {"ampere": 20.0, "hopper": 20.6}
NVLINK_DATASHEET_GBPS = 25.0  # one NVLink 3 / 4 link, one way (A100: 12 make 300 GB/s)
P2P_LL_THRESHOLD = 16384
assert set(NCCL_ARCHS) == set(NVLINK_LINK_GBPS)


class Channels(NamedTuple):
    """What NCCL's graph search is taken to find: `number` channels of `speed` GB/s each."""

    number: float
    speed: float


class Choice(NamedTuple):
    """NCCL's pick for one collective and size, and its predicted seconds."""

    algorithm: str
    protocol: str
    seconds: float


def communicator(group: int, stride: int, devices_per_node: int) -> tuple[int, int]:
    """(ranks per node, nodes) of `group` ranks `stride` apart in the rank order."""
    local = max(1, min(group, devices_per_node // stride))
    return local, math.ceil(group / local)


def _speed(speeds: tuple[float, ...], limit: float) -> float:
    return next((speed for speed in speeds if speed <= limit), speeds[-1])


def channels(cluster: ClusterSpec, local: int, nodes: int) -> Channels:
    """The ring's channels for a communicator of `local` ranks on each of `nodes` nodes."""
    arch = cluster.nccl_arch
    # the GPU's NVLink links (`ClusterSpec.nvlink_links`, which `runtime_memory` counts
    # channels by too), else as many as its bandwidth makes at the datasheet's 25 GB/s a link
    links = cluster.nvlink_links or cluster.intra_bandwidth / 1e9 / NVLINK_DATASHEET_GBPS
    nvlink = links * NVLINK_LINK_GBPS[arch]
    if nodes == 1:
        speed = _speed(SPEEDS_INTRA[arch], nvlink)
        count: float = max(1, math.floor(nvlink / speed))
    else:
        share = cluster.device_inter_bandwidth / 1e9
        nic = cluster.nic_bandwidth / 1e9 if cluster.nics_per_node and cluster.nic_bandwidth \
            else share
        speed = _speed(SPEEDS_INTER[arch], min(nic, nvlink))
        count = local * share / nic  # the NICs' worth the communicator's ranks hold
    # ncclTopoDupChannels: twice the channels at half the speed
    if speed >= 25.0 and not (arch == "hopper" and speed < 50.0 and count > 4):
        count, speed = 2 * count, speed / 2
    return Channels(count, speed)


def _row(nodes: int) -> int:
    return min(nodes, 3) - 1


def bandwidth(collective: str, algorithm: str, protocol: int, ranks: int, nodes: int,
              arch: str, ring: Channels) -> float:
    """GB/s of algorithm bandwidth NCCL predicts (`ncclTopoTuneModel`); 0: not used."""
    row = _row(nodes)
    bus = ring.number * ring.speed
    ll_max = LL_MAX_BW[arch if nodes == 1 else "intel"][row]
    if algorithm == "ring":
        if protocol == LL:
            bus = min(ll_max, bus * .5)
        elif protocol == LL128:
            bus = min(bus * .92, ring.number * RING_LL128_BW[arch][row])
        steps = 2 * (ranks - 1) if collective == "allreduce" else ranks - 1
        return bus * ranks / steps
    if algorithm == "tree":
        if collective != "allreduce":
            return 0.0
        bus = min(bus * .92, ring.number * TREE_BW[arch][row])
        if protocol == LL:
            bus = min(bus / 3.8, ll_max)
        elif protocol == LL128:
            bus = min(bus * (7 / 9 if nodes == 1 else 120 / 128),
                      ring.number * TREE_LL128_BW[arch][row])
        return bus * .5
    # PAT: reduce-scatter and all-gather, Simple, one rank per node only (ncclPatEnable)
    if collective == "allreduce" or protocol != SIMPLE or ranks != nodes:
        return 0.0
    return bus * .75


def latency(collective: str, algorithm: str, protocol: int, ranks: int, nodes: int) -> float:
    """µs of latency NCCL predicts (`ncclTopoTuneModel`), before `predicted_seconds`'s
    size-dependent corrections."""
    seconds = BASE_LATENCY[algorithm][protocol]
    intra = HW_LATENCY["nvlink"][algorithm][protocol]
    per_node = ranks / nodes
    # with one rank a node every latency is exposed: the tree's network latency
    inter = HW_LATENCY["net"]["tree" if per_node == 1 else algorithm][protocol]
    if algorithm == "ring":
        if nodes > 1:  # inter-node rings still launch each step's network post
            intra = max(intra, NET_OVERHEAD_US * (3 if protocol == SIMPLE else 1))
        steps = 2 * (ranks - 1) if collective == "allreduce" else ranks - 1
        inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if collective == "allreduce"
                                            else nodes - 1)
        return seconds + (steps - inter_steps) * intra + inter_steps * inter
    log_nodes = nodes.bit_length() - 1
    if algorithm == "tree":  # up the chain in the node, up the tree between, and back
        return seconds + 2 * ((per_node - 1) * intra + log_nodes * inter)
    return seconds + log_nodes * inter / 3.5 + ranks * 2.8


def predicted_seconds(collective: str, algorithm: str, protocol: int, nbytes: float,
                      ranks: int, nodes: int, arch: str, ring: Channels) -> float:
    """Seconds NCCL predicts for one algorithm and protocol (`ncclTopoGetAlgoTime`, one
    operation); inf where NCCL does not use it. `nbytes`: the whole buffer (all ranks' parts
    for reduce-scatter and all-gather, as NCCL counts them)."""
    speed = bandwidth(collective, algorithm, protocol, ranks, nodes, arch, ring)
    if speed <= 0:
        return math.inf
    lat = latency(collective, algorithm, protocol, ranks, nodes)
    log_size = int(nbytes) // 64
    log_size = log_size.bit_length() - 1
    if algorithm == "tree" and 0 <= log_size < 23:
        speed *= TREE_CORRECTION[protocol][log_size]
    if algorithm == "ring" and protocol == SIMPLE and nodes > 1 and collective == "allreduce" \
            and nbytes / (ring.number * ranks) >= 64:
        lat *= RING_PLATEAU
    return (lat + nbytes / (1000 * speed)) * 1e-6


def choose(collective: str, nbytes: float, ranks: int, local: int, cluster: ClusterSpec
           ) -> Choice:
    """NCCL's pick (the lowest predicted time over ring, tree and PAT and LL, LL128, Simple)
    for `collective` of `nbytes` over `ranks` ranks, `local` of them on each node."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective {collective!r} must be one of {', '.join(COLLECTIVES)}")
    if cluster.nccl_arch not in NCCL_ARCHS:
        raise ValueError(f"cluster {cluster.name!r} has nccl_arch={cluster.nccl_arch!r}; "
                         f"NCCL's model needs one of {', '.join(NCCL_ARCHS)}")
    if ranks <= 1 or nbytes <= 0:
        return Choice("none", "none", 0.0)
    nodes = math.ceil(ranks / local)
    ring = channels(cluster, local, nodes)
    return min((Choice(algorithm, PROTOCOLS[protocol], predicted_seconds(
        collective, algorithm, protocol, nbytes, ranks, nodes, cluster.nccl_arch, ring))
        for algorithm in ("ring", "tree", "pat") for protocol in (LL, LL128, SIMPLE)),
        key=lambda choice: choice.seconds)


def p2p_link(cluster: ClusterSpec, span: int, nbytes: float = math.inf
             ) -> tuple[float, float]:
    """(bytes/s, seconds) of a message between ranks `span` apart: one hop of NCCL's ring
    (its base latency and the hop's hardware latency), over the GPU's NVLink channels inside
    a node or its NIC share between nodes; LL (half the bandwidth) for a message of at most
    `P2P_LL_THRESHOLD` bytes a channel, Simple above."""
    nodes = 1 if span <= cluster.devices_per_node else 2
    ring = channels(cluster, 1, nodes)
    protocol = LL if nbytes <= ring.number * P2P_LL_THRESHOLD else SIMPLE
    hop = HW_LATENCY["nvlink" if nodes == 1 else "net"]["ring"][protocol]
    speed = ring.number * ring.speed * (.5 if protocol == LL else 1.0)
    return speed * 1e9, (BASE_LATENCY["ring"][protocol] + hop) * 1e-6
