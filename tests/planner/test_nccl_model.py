"""NCCL's cost model (`pipeline.planner.nccl_model`): its constants against NCCL's source, its
algorithm/protocol pick against an oracle transcribed from `ncclTopoTuneModel` and
`ncclTopoGetAlgoTime`, monotonicity, and a planted bug the oracle catches."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.planner import PRESETS, nccl_model
from pipeline.planner.cluster import cluster_from_json
from pipeline.planner.device_profile import apply_device_profile, write_device_profile
from pipeline.planner.errors import PlanError
from pipeline.planner.nccl_model import Channels
from pipeline.planner.pricing import (
    allgather_seconds,
    allreduce_seconds,
    p2p_seconds,
    reduce_scatter_seconds,
)

__all__: list[str] = []

A100, H100, A800 = PRESETS["a100-80g"], PRESETS["h100-80g"], PRESETS["a800-80g"]


def test_constants_are_nccl_sources() -> None:
    """Transcribed again from NVIDIA/nccl 5067397c26 (src/graph/tuning.cc
    `ncclTunerConstantsDefaults`, `treeCorrectionFactor`; src/graph/search.cc speed
    arrays; src/graph/topo.h SM80/SM90_NVLINK_BW; src/enqueue.cc P2P_LL_THRESHOLD)."""
    assert nccl_model.NCCL_COMMIT.startswith("5067397c26")
    assert nccl_model.BASE_LATENCY["tree"] == (6.8, 14.0, 8.4)
    assert nccl_model.BASE_LATENCY["ring"] == (6.6, 14.0, 8.4)
    assert nccl_model.HW_LATENCY["nvlink"]["tree"] == (0.6, 1.25, 4.0)
    assert nccl_model.HW_LATENCY["nvlink"]["ring"] == (0.6, 1.9, 3.4)
    assert nccl_model.HW_LATENCY["net"]["tree"] == (5.0, 8.5, 14)
    assert nccl_model.HW_LATENCY["net"]["ring"] == (2.7, 4.0, 14.0)
    # llMaxBws: {39.0, 39.0, 20.4} Volta-N1/Intel-N2/Intel-N4, Ampere-N1 87.7, Hopper-N1 141
    assert nccl_model.LL_MAX_BW["intel"] == (39.0, 39.0, 20.4)
    assert nccl_model.LL_MAX_BW["ampere"][0] == 87.7
    assert nccl_model.LL_MAX_BW["hopper"][0] == 141.0
    assert nccl_model.RING_LL128_BW == {"ampere": (20.0,) * 3, "hopper": (36.7,) * 3}
    assert nccl_model.TREE_LL128_BW["hopper"] == (36.7, 36.7, 29.0)
    assert nccl_model.TREE_BW == {"ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0)}
    assert nccl_model.TREE_CORRECTION[0][10:14] == (.6, .5, .4, .4)
    assert nccl_model.TREE_CORRECTION[2][:8] == (.9,) * 7 + (.8,)
    assert all(len(row) == 24 for row in nccl_model.TREE_CORRECTION)
    assert nccl_model.SPEEDS_INTRA["ampere"][:3] == (40.0, 30.0, 20.0)
    assert nccl_model.SPEEDS_INTRA["hopper"][:3] == (60.0, 50.0, 40.0)
    assert nccl_model.SPEEDS_INTER["ampere"][:4] == (48.0, 30.0, 28.0, 24.0)
    assert nccl_model.SPEEDS_INTER["hopper"][:4] == (48.0, 45.0, 42.0, 40.0)
    assert nccl_model.NVLINK_LINK_GBPS == {"ampere": 20.0, "hopper": 20.6}
    assert nccl_model.P2P_LL_THRESHOLD == 16384


def test_channels_are_what_the_graph_search_would_keep() -> None:
    # one node: 12 NVLinks × 20 GB/s = 240: 6 channels at 40, doubled to 12 at 20
    assert nccl_model.channels(A100, 8, 1) == Channels(12, 20.0)
    # H100: 18 × 20.6 = 370.8: 6 at 60, doubled (Hopper: at >= 50 GB/s) to 12 at 30
    assert nccl_model.channels(H100, 8, 1) == Channels(12, 30.0)
    assert nccl_model.channels(A800, 8, 1) == Channels(8, 20.0)  # 8 links: 4 at 40, doubled
    # across nodes: one channel a NIC at the speed below it (25 -> 24, 50 -> 48), not doubled
    assert nccl_model.channels(A100, 8, 4) == Channels(8, 24.0)
    assert nccl_model.channels(H100, 8, 4) == Channels(8, 48.0)
    # one rank a node: its own NIC; Hopper doubles a channel count of 4 or fewer
    assert nccl_model.channels(A100, 1, 16) == Channels(1, 24.0)
    assert nccl_model.channels(H100, 1, 16) == Channels(2, 24.0)


# --- the oracle: ncclTopoTuneModel's loop for ring and tree all-reduce, as written there ---

def _oracle(nbytes: float, ranks: int, nodes: int, arch: str, n_channels: float, bw: float,
            ) -> dict[tuple[str, str], float]:
    """Seconds of every (algorithm, protocol) NCCL times for an all-reduce."""
    index2 = nodes - 1 if nodes <= 2 else 2
    ll_max = {"ampere": 87.7, "hopper": 141.0}[arch] if nodes == 1 \
        else (39.0, 39.0, 20.4)[index2]
    ring_ll128 = {"ampere": 20.0, "hopper": 36.7}[arch]
    tree_max = {"ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0)}[arch][index2]
    tree_ll128 = {"ampere": (20.0,) * 3, "hopper": (36.7, 36.7, 29.0)}[arch][index2]
    base = {"tree": [6.8, 14.0, 8.4], "ring": [6.6, 14.0, 8.4]}
    hw_nvl = {"tree": [0.6, 1.25, 4.0], "ring": [0.6, 1.9, 3.4]}
    hw_net = {"tree": [5.0, 8.5, 14.0], "ring": [2.7, 4.0, 14.0]}
    correction = [[1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7,
                   .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0],
                  [1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8,
                   .9, .9, .9, .9, 1.0, 1.0, 1.0],
                  [.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8,
                   .7, .7, .8, .9, .9, .9]]
    ppn = ranks / nodes
    nsteps = 2 * (ranks - 1)
    times = {}
    for a in ("tree", "ring"):
        for p, proto in enumerate(("LL", "LL128", "Simple")):
            bus = n_channels * bw
            if a == "ring" and p == 0:
                bus = min(ll_max, bus * .5)
            if a == "ring" and p == 1:
                bus = min(bus * .92, n_channels * ring_ll128)
            if a == "tree":
                bus = min(bus * .92, n_channels * tree_max)
            if a == "tree" and p == 0:
                bus = min(bus / 3.8, ll_max)
            if a == "tree" and p == 1:
                bus = min(bus * (7 / 9 if nodes == 1 else 120 / 128), n_channels * tree_ll128)
            bus *= ranks / nsteps if a == "ring" else .5
            lat = base[a][p]
            intra = hw_nvl[a][p]
            inter = hw_net["tree" if ppn == 1 else a][p]
            if a == "ring":
                overhead = (3.0 if p == 2 else 1.0) if nodes > 1 else 0.0
                intra = max(intra, overhead)
                n_inter = 0 if nodes == 1 else 2 * (nodes - 1)
                lat += (nsteps - n_inter) * intra + n_inter * inter
            else:
                lat += 2 * ((ppn - 1) * intra + int(math.log2(nodes)) * inter)
            log_size = int(math.log2(int(nbytes) >> 6)) if int(nbytes) >> 6 else -1
            if a == "tree" and 0 <= log_size < 23:
                bus *= correction[p][log_size]
            if a == "ring" and p == 2 and nodes > 1 and nbytes / (n_channels * ranks) >= 64:
                lat *= 1.4
            times[a, proto] = (lat + nbytes / (1000 * bus)) * 1e-6
    return times


# (cluster, ranks a node, nodes, the channels NCCL_DEBUG=INFO would print for it)
_CASES = ((A100, 8, 1, 12, 20.0), (H100, 8, 1, 12, 30.0), (A100, 8, 2, 8, 24.0),
          (H100, 8, 16, 8, 48.0), (A100, 8, 384, 8, 24.0), (H100, 1, 64, 2, 24.0),
          (A100, 1, 16, 1, 24.0))
_SIZES = (256.0, 8e3, 300e3, 4e6, 64e6, 300e6, 1e9)


def _mismatches() -> list[str]:
    wrong = []
    for cluster, local, nodes, n_channels, bw in _CASES:
        big = replace(cluster, nodes=nodes)
        ring = nccl_model.channels(big, local, nodes)
        for nbytes in _SIZES:
            want = _oracle(nbytes, local * nodes, nodes, cluster.nccl_arch, n_channels, bw)
            case = f"{cluster.name} {local}x{nodes} {nbytes:g} B"
            for (algorithm, protocol), seconds in want.items():
                mine = nccl_model.predicted_seconds(
                    "allreduce", algorithm, nccl_model.PROTOCOLS.index(protocol), nbytes,
                    local * nodes, nodes, cluster.nccl_arch, ring)
                if not math.isclose(mine, seconds, rel_tol=1e-9):
                    wrong.append(f"{case} {algorithm} {protocol}: {mine} vs {seconds}")
            pick = min(want, key=want.__getitem__)
            got = nccl_model.choose("allreduce", nbytes, local * nodes, local, big)
            if (got.algorithm, got.protocol) != pick \
                    or not math.isclose(got.seconds, want[pick], rel_tol=1e-9):
                wrong.append(f"{case}: {got} vs {pick} {want[pick]}")
    return wrong


def test_the_pick_and_its_time_equal_the_oracle() -> None:
    assert _mismatches() == []


def test_thousands_of_ranks_reduce_small_buckets_by_tree_large_ones_few_nodes_by_ring() -> None:
    big = replace(A100, nodes=384)
    small = nccl_model.choose("allreduce", 4e6, 3072, 8, big)
    assert small.algorithm == "tree"
    # its latency grows with log2 of the nodes, the ring's with the ranks
    assert nccl_model.latency("allreduce", "tree", 2, 3072, 384) < 300
    assert nccl_model.latency("allreduce", "ring", 2, 3072, 384) > 20_000
    few = nccl_model.choose("allreduce", 1e9, 32, 8, replace(A100, nodes=4))
    assert (few.algorithm, few.protocol) == ("ring", "Simple")
    tiny = nccl_model.choose("allreduce", 1e3, 8, 8, A100)
    assert tiny.protocol == "LL"  # LL's 8-byte lines: half the bandwidth, least latency


def test_a_planted_bug_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the ring's all-reduce counted as n - 1 steps (a reduce-scatter's), and the
    tree's per-channel cap dropped: each must fail the oracle."""
    real = nccl_model.latency
    monkeypatch.setattr(nccl_model, "latency", lambda collective, *rest: real(
        "reducescatter" if collective == "allreduce" else collective, *rest))
    assert _mismatches()
    monkeypatch.undo()
    monkeypatch.setattr(nccl_model, "TREE_BW", {"ampere": (1e9,) * 3, "hopper": (1e9,) * 3})
    assert _mismatches()


@pytest.mark.parametrize("cluster", [A100, H100])
def test_more_bytes_or_more_nodes_never_take_less_time(cluster: object) -> None:
    assert isinstance(cluster, type(A100))
    sizes = [2.0 ** k for k in range(4, 33)]
    for local, nodes in ((8, 1), (8, 2), (8, 64), (1, 32)):
        big = replace(cluster, nodes=nodes)
        for collective in ("allreduce", "reducescatter", "allgather"):
            times = [nccl_model.choose(collective, n, local * nodes, local, big).seconds
                     for n in sizes]
            assert times == sorted(times), (collective, local, nodes)
    for nbytes in (1e4, 1e6, 1e8, 1e10):
        times = [allreduce_seconds(nbytes, 8 * nodes, 1, replace(cluster, nodes=nodes))
                 for nodes in (1, 2, 4, 16, 128, 1024)]
        assert times == sorted(times), nbytes
        # a large reduce-scatter is at most an all-reduce (a small one across nodes need not
        # be: NCCL has no tree for it, its ring pays 63 steps' latency at 64 ranks)
        if nbytes >= 1e8:
            assert reduce_scatter_seconds(nbytes, 64, 1, replace(cluster, nodes=8)) \
                <= allreduce_seconds(nbytes, 64, 1, replace(cluster, nodes=8))
        # a slower network is never faster
        slow = replace(cluster, nodes=8, nic_bandwidth=cluster.nic_bandwidth / 4)
        assert allreduce_seconds(nbytes, 64, 1, slow) \
            >= allreduce_seconds(nbytes, 64, 1, replace(cluster, nodes=8))


def test_pricing_routes_through_nccl_only_with_nccl_arch() -> None:
    cluster = replace(A100, nodes=4)
    assert allreduce_seconds(1e8, 32, 1, cluster) == nccl_model.choose(
        "allreduce", 1e8, 32, 8, cluster).seconds
    assert allgather_seconds(1e8, 4, 8, cluster) == nccl_model.choose(
        "allgather", 1e8, 4, 1, cluster).seconds
    alpha_beta = replace(cluster, nccl_arch="")
    assert reduce_scatter_seconds(1e8, 32, 1, alpha_beta) == pytest.approx(
        allreduce_seconds(1e8, 32, 1, alpha_beta) / 2)
    # a message over NVLink: one ring hop, Simple: 8.4 + 3.4 µs and 240 GB/s
    assert p2p_seconds(1e8, 2, A100) == pytest.approx((8.4 + 3.4) * 1e-6 + 1e8 / 240e9)
    assert p2p_seconds(1e8, 2, alpha_beta) == pytest.approx(5e-6 + 1e8 / 240e9)


def test_bad_arch_and_collective_are_refused() -> None:
    with pytest.raises(PlanError, match="nccl_arch='volta' must be one of ampere, hopper"):
        replace(A100, nccl_arch="volta")
    with pytest.raises(ValueError, match="collective 'broadcast' must be one of"):
        nccl_model.choose("broadcast", 1e6, 8, 8, A100)
    with pytest.raises(ValueError, match="needs one of ampere, hopper"):
        nccl_model.choose("allreduce", 1e6, 8, 8, replace(A100, nccl_arch=""))
    assert cluster_from_json({"preset": "h100-80g", "nccl_arch": ""}).nccl_arch == ""


def test_a_measured_device_profile_prices_its_collectives_alpha_beta(tmp_path: Path) -> None:
    """Measured all-reduce figures are what was reached: NCCL's NVLink rating must not be
    applied to them again."""
    path = tmp_path / "dev.json"
    write_device_profile(path, {"device": "x", "precision": "bf16",
                                "gemms": [[1024, 1024, 1024, 1e-5]], "memory_bandwidth": 3e12,
                                "collectives": {"latency": 2e-5, "allreduce_bandwidth": 1e11}})
    measured = apply_device_profile(H100, path)
    assert measured.nccl_arch == ""
    assert allreduce_seconds(1e9, 8, 1, measured) == pytest.approx(2 * 7 / 8 * 1e9 / 1e11
                                                                   + 14 * 2e-5)


def test_the_nvlink_links_are_the_clusters_own_when_it_names_them() -> None:
    """The intra-node channels read the NVLink links the cluster names (`nvlink_links`, the
    count the runtime's NCCL buffers use too), and only without them the bandwidth's worth at
    25 GB/s a link: the presets agree either way; a cluster naming fewer links gets fewer."""
    from dataclasses import replace

    from pipeline.planner import PRESETS

    for preset in ("a100-80g", "h100-80g", "a800-80g"):
        cluster = PRESETS[preset]
        assert nccl_model.channels(cluster, 8, 1) == nccl_model.channels(
            replace(cluster, nvlink_links=0), 8, 1)
    h100 = PRESETS["h100-80g"]
    assert nccl_model.channels(replace(h100, nvlink_links=4), 8, 1).number \
        < nccl_model.channels(h100, 8, 1).number
