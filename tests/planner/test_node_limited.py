"""Issue 48: the cross-node all-to-all under group-limited (node-limited) routing, one copy
per node (DeepEP) against one per (token, expert) pair, checked against a Monte-Carlo oracle
that samples the routing as its definition says; the DeepSeek-V3 figure; the HF config and
model-string paths; refusals."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.planner import PRESETS, PlanConfig, SearchOptions, load_model
from pipeline.planner.engines import engine_options
from pipeline.planner.errors import PlanError
from pipeline.planner.expert_parallel import all_to_all_seconds
from pipeline.planner.hf_config import expert_shape_from_hf, shape_from_hf_config
from pipeline.planner.launch import LaunchTarget, launch_lines
from pipeline.planner.node_limited import (
    ExpertRouting,
    cross_node_copies,
    node_hit_probabilities,
    node_members,
    off_node_scale,
)
from pipeline.planner.search import price
from pipeline.planner.shape_parse import parse_shape

__all__: list[str] = []

V3 = ExpertRouting(experts=256, topk=8, groups=8, top_groups=4)
"""DeepSeek-V3's routing (its config: n_routed_experts 256, num_experts_per_tok 8, n_group 8,
topk_group 4)."""


def _sampled(routing: ExpertRouting, members: tuple[int, ...], tokens: int,
             seed: int = 0) -> tuple[np.ndarray, float, float]:
    """The oracle: route `tokens` tokens by the definition (a uniform M-subset of the G
    groups, then a uniform k-subset of their experts), each from a uniform source rank; the
    experts E / ep a rank in rank order, the ranks `members` a node. Returns each node's hit
    frequency, the mean distinct remote nodes a token reaches and its mean remote copies."""
    rng = np.random.default_rng(seed)
    E, k, G, M = routing.experts, routing.topk, routing.groups, routing.top_groups
    ep = sum(members)
    rank_node = np.repeat(np.arange(len(members)), members)
    expert_node = rank_node[np.arange(E) // (E // ep)]
    groups = np.argsort(rng.random((tokens, G), dtype=np.float32), axis=1)[:, :M]
    allowed = (groups[:, :, None] * (E // G) + np.arange(E // G)).reshape(tokens, -1)
    pick = np.argsort(rng.random(allowed.shape, dtype=np.float32), axis=1)[:, :k]
    nodes = expert_node[np.take_along_axis(allowed, pick, axis=1)]  # [tokens, k]
    hit = np.zeros((tokens, len(members)), dtype=bool)
    np.put_along_axis(hit, nodes, True, axis=1)
    source = rank_node[rng.integers(0, ep, tokens)]
    remote_nodes = hit.sum(axis=1) - hit[np.arange(tokens), source]
    remote_copies = (nodes != source[:, None]).sum(axis=1)
    return hit.mean(axis=0), float(remote_nodes.mean()), float(remote_copies.mean())


CASES = [
    (V3, node_members(64, 1, 8)),         # 8 groups on 8 nodes: at most 4 nodes a token
    (V3, node_members(64, 2, 8)),         # tp 2: 16 nodes, two a group (at most 8)
    (V3, node_members(32, 1, 8)),         # 4 nodes of two groups each
    (ExpertRouting(160, 6, 8, 3), (8, 2)),  # DeepSeek-V2's: groups of 20 straddle ranks
    (ExpertRouting(60, 4), (8, 4)),       # no group limit, a part-filled last node
]


@pytest.mark.parametrize(("routing", "members"), CASES)
def test_distinct_nodes_match_a_monte_carlo_oracle(routing: ExpertRouting,
                                                   members: tuple[int, ...]) -> None:
    tokens = 40_000
    frequency, remote_nodes, remote_copies = _sampled(routing, members, tokens)
    hits = np.array(node_hit_probabilities(routing, members))
    error = np.sqrt(hits * (1 - hits) / tokens)
    assert np.all(np.abs(frequency - hits) <= 5 * error + 1e-9), (frequency, hits)
    # a token's remote nodes lie in 0..min(k, nodes): a standard error under k / sqrt(n)
    bound = 5 * routing.topk / math.sqrt(tokens)
    assert cross_node_copies(routing, members, "deepep") == pytest.approx(remote_nodes,
                                                                          abs=bound)
    assert cross_node_copies(routing, members, "alltoall") == pytest.approx(remote_copies,
                                                                            abs=bound)


def test_deepseek_v3_closed_form_and_the_node_limit() -> None:
    """Written from the definition: a token's 4 groups are 4 nodes, each missed when all 8
    experts fall in the other 3 groups' 96 of the 128 allowed; 7 of 8 nodes are remote."""
    members = node_members(64, 1, 8)
    missed = math.comb(96, 8) / math.comb(128, 8)
    assert cross_node_copies(V3, members, "deepep") == pytest.approx(4 * (1 - missed) * 7 / 8)
    unlimited = ExpertRouting(256, 8)  # any 8 of 256 over 8 nodes of 32
    missed = math.comb(224, 8) / math.comb(256, 8)
    assert cross_node_copies(unlimited, members, "deepep") == pytest.approx(
        8 * (1 - missed) * 7 / 8)
    assert sum(node_hit_probabilities(V3, members)) <= 4  # the node limit caps it


def test_deepseek_v3_per_expert_dispatch_sends_about_twice_the_cross_node_bytes(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 48: the per-expert all-to-all prices DeepSeek-V3 at ep 64 over 8 nodes at about
    twice the cross-node bytes its node-limited routing sends through DeepEP."""
    members = node_members(64, 1, 8)
    per_expert = cross_node_copies(V3, members, "alltoall")
    per_node = cross_node_copies(V3, members, "deepep")
    ratio = per_expert / per_node
    with capsys.disabled():
        print(f"\nDeepSeek-V3 routing at ep 64 over 8 nodes: {per_expert:.3f} remote copies a "
              f"token per expert, {per_node:.3f} per node; ratio {ratio:.3f}")
    assert per_expert == pytest.approx(7.0)
    assert 1.8 < ratio < 2.6
    assert off_node_scale(V3, 64, 1, 8, "deepep") == pytest.approx(1 / ratio)
    # the seconds: the network part shrinks by that factor, NVLink's is kept, the slower
    # of the two bounds it (a slow NVLink variant makes NVLink's the slower under deepep)
    nbytes = 4096 * 8 * 7168 * 2  # s·k·h·e of one sample
    h100 = replace(PRESETS["h100-80g"], nodes=8)
    for cluster in (h100, replace(h100, intra_bandwidth=h100.intra_bandwidth / 40)):
        network_bandwidth, network_latency = cluster.link(cluster.devices_per_node + 1)
        network = nbytes * 56 / 64 / network_bandwidth
        nvlink_bandwidth, nvlink_latency = cluster.link(1)
        nvlink = nvlink_latency + nbytes * 7 / 64 / nvlink_bandwidth
        alltoall = all_to_all_seconds(nbytes, 64, 1, cluster, routing=V3)
        deepep = all_to_all_seconds(nbytes, 64, 1, cluster, routing=V3, dispatcher="deepep")
        assert alltoall == pytest.approx(max(nvlink, network_latency + network))
        assert deepep == pytest.approx(max(nvlink, network_latency + network / ratio))
    assert nvlink > network_latency + network / ratio  # the variant tested that side
    assert all_to_all_seconds(nbytes, 8, 1, cluster, routing=V3, dispatcher="deepep") \
        == all_to_all_seconds(nbytes, 8, 1, cluster, routing=V3)  # within a node: as before


MOE = ("layers=4,hidden=1024,heads=16,kv_heads=4,vocab=32000,seq=1024,mlp=swiglu,"
       "norm=rmsnorm,bias=none,learned_positions=false,experts=64,topk=6,expert_ffn=512")


def test_the_plan_prices_the_dispatcher_across_nodes_only() -> None:
    model = load_model(MOE + ",expert_groups=8,topk_groups=3", sequence_parallel=True)
    assert model.routing == ExpertRouting(64, 6, 8, 3)
    cluster = replace(PRESETS["h100-80g"], nodes=4)

    def ep_comm(ep: int, dispatcher: str) -> float:
        config = PlanConfig(pp=1, tp=1, dp=32, schedule="1f1b", chunks=1, microbatch_size=1,
                            num_microbatches=2, zero_stage=1, recompute="none", ep=ep)
        options = SearchOptions(**engine_options("megatron-core", moe_dispatcher=dispatcher))
        return price(model, cluster, 64, config, options=options).breakdown["ep_comm"]

    assert 0 < ep_comm(32, "deepep") < ep_comm(32, "alltoall")
    assert ep_comm(8, "deepep") == ep_comm(8, "alltoall")


def test_deepseek_v3_config_gives_its_group_limit() -> None:
    config = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
              "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
              "n_shared_experts": 1, "first_k_dense_replace": 3, "n_group": 8,
              "topk_group": 4, "intermediate_size": 18432}
    moe = expert_shape_from_hf(config)
    assert moe is not None and moe.routing == V3
    assert (moe.shared_ffn, moe.dense_layers) == (2048, (0, 1, 2))
    keys = moe.model_string()
    assert "expert_groups=8,topk_groups=4" in keys
    shape = parse_shape("layers=61,hidden=7168,heads=128,vocab=129280,seq=4096,bias=none,"
                        + keys)
    assert shape.moe == moe  # the keys read back
    priced = shape_from_hf_config(config | {  # its latent attention priced (the defaults)
        "num_attention_heads": 128, "vocab_size": 129280, "max_position_embeddings": 4096})
    assert priced.moe == moe and priced.latent is not None
    v2 = config | {"model_type": "deepseek_v2", "topk_method": "group_limited_greedy",
                   "n_group": 8, "topk_group": 3, "n_routed_experts": 160,
                   "num_experts_per_tok": 6}
    grouped = expert_shape_from_hf(v2)
    assert grouped is not None and grouped.routing == ExpertRouting(160, 6, 8, 3)
    greedy = expert_shape_from_hf(v2 | {"topk_method": "greedy"})
    assert greedy is not None and greedy.expert_groups == 1  # HF's V2 ignores the groups


def test_the_megatron_core_line_carries_the_dispatcher_and_groups() -> None:
    config = PlanConfig(pp=1, tp=1, dp=64, schedule="1f1b", chunks=1, microbatch_size=1,
                        num_microbatches=1, zero_stage=1, recompute="none", ep=64)
    target = LaunchTarget(engine="megatron-core", experts=256, moe_dispatcher="deepep",
                          expert_groups=(8, 4), nodes=8, devices_per_node=8)
    line = launch_lines("megatron-core", config, 64, 61, target=target)[0]
    assert ("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep "
            "--moe-router-dtype fp32") in line
    assert "--moe-router-num-groups 8 --moe-router-group-topk 4" in line
    plain = launch_lines("megatron-core", config, 64, 61,
                         target=replace(target, moe_dispatcher="alltoall", expert_groups=(1, 1)))
    assert "--moe-token-dispatcher-type alltoall" in plain[0] and "groups" not in plain[0]


@pytest.mark.parametrize(("keys", "words"), [
    ("expert_groups=8,topk_groups=9", "topk_groups=9 must be at most expert_groups=8"),
    ("expert_groups=7,topk_groups=2", "expert_groups=7 must divide experts=64"),
    ("expert_groups=32,topk_groups=2", "hold fewer than topk=6"),
    ("expert_groups=0", "expert_groups=0 must be a whole number >= 1"),
    ("topk_groups=2", "topk_groups=2 must be at most expert_groups=1"),
])
def test_bad_group_limits_are_refused_in_one_line(keys: str, words: str) -> None:
    with pytest.raises(PlanError, match=words) as caught:
        parse_shape(f"{MOE},{keys}")
    assert "\n" not in str(caught.value)


def test_a_dispatcher_the_engine_does_not_run_is_refused() -> None:
    with pytest.raises(PlanError, match="pipesched does not run the 'deepep' token dispatcher"):
        engine_options("pipesched", moe_dispatcher="deepep")
    with pytest.raises(PlanError, match="prices no MoE"):
        engine_options("deepspeed", moe_dispatcher="alltoall")
    with pytest.raises(PlanError, match="moe_dispatcher='nccl' must be one of"):
        SearchOptions(moe_dispatcher="nccl")
    with pytest.raises(PlanError, match="routing"):  # deepep across nodes needs the top-k
        off_node_scale(None, 64, 1, 8, "deepep")
    with pytest.raises(PlanError, match="groups"):
        parse_shape("layers=4,hidden=64,heads=4,vocab=100,seq=16,expert_groups=8")


def test_the_command_line_prices_and_prints_the_dispatcher(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", MOE + ",expert_groups=8,topk_groups=3", "--cluster",
            "h100-80g", "--nodes", "4", "--global-batch", "64", "--price",
            "pp1,tp1,dp32,ep32,1f1b,b1", "--moe-dispatcher", "deepep"]
    assert main([*argv, "--engine", "megatron-core"]) == 0
    out = capsys.readouterr().out
    assert "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep" in out
    assert "--moe-router-num-groups 8 --moe-router-group-topk 3" in out
    assert main(argv) == 2  # this engine dispatches per expert
    err = capsys.readouterr().err
    assert err.startswith("pipesched plan: error:") and "does not run the 'deepep'" in err
