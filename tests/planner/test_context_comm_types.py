"""`--engine megatron-core --cp-comm-type a2a | allgather`: Transformer Engine's Ulysses
all-to-all and K/V all-gather priced against oracles of their steps, planted bugs caught,
the a2a head rule, the printed flag, p2p unchanged."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace

import pytest

from pipeline.cli import main
from pipeline.planner import (
    PlanConfig,
    SearchOptions,
    context_comm,
    load_model,
    plan,
    resolve_cluster,
)
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.engines import engine_options
from pipeline.planner.errors import PlanError
from pipeline.planner.pricing import (
    allgather_seconds,
    layer_selective_seconds,
    reduce_scatter_seconds,
)
from pipeline.planner.search import _context
from pipeline.planner.stages import StageCosts

__all__: list[str] = []

# 16 heads and 4 K/V heads of 64, bf16: Q and O are 16·64·2 bytes a token, K and V 4·64·2
GQA = ("layers=8,hidden=1024,heads=16,kv_heads=4,vocab=32000,seq=1024,mlp=swiglu,"
       "norm=rmsnorm,bias=none")
LONG = ("layers=4,hidden=1024,heads=16,kv_heads=4,vocab=32000,seq=8192,mlp=swiglu,"
        "norm=rmsnorm,bias=none")
MHA = LONG.replace("kv_heads=4", "kv_heads=16")  # 16 K/V heads: a2a splits them over tp · cp 16
Q_TOKEN = 16 * 64 * 2


def _all_to_all(nbytes: float, cp: int, tp: int, cluster: ClusterSpec) -> float:
    """One all-to-all of `nbytes` a rank holds, cp members tp apart: every pair at once,
    nbytes/cp to each peer; the peers on the node over NVLink, the rest over the network,
    each link's latency once, the slower bounding it."""
    on_node = min(cp, cluster.devices_per_node // tp)
    inside, latency = cluster.link(1)
    seconds = latency + (on_node - 1) * nbytes / cp / inside if on_node > 1 else 0.0
    if cp > on_node:
        network, far = cluster.link(cluster.devices_per_node + 1)
        seconds = max(seconds, far + (cp - on_node) * nbytes / cp / network)
    return seconds


def _collective(kind: str, whole: float, cp: int, tp: int, cluster: ClusterSpec) -> float:
    """An all-gather or reduce-scatter whose whole buffer is `whole` bytes over cp ranks tp
    apart: NCCL's model with `nccl_arch`, else a ring, (cp−1)/cp of it and cp−1 hops."""
    if cluster.nccl_arch:
        return (allgather_seconds if kind == "gather" else reduce_scatter_seconds)(
            whole, cp, tp, cluster)
    bandwidth, latency = cluster.link(cp * tp)
    return (cp - 1) / cp * whole / bandwidth + (cp - 1) * latency


def _oracle(kind: str, seq: int, cp: int, tp: int, cluster: ClusterSpec, kv_heads: int = 4
            ) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one block, one sample, from TE's algorithm.
    a2a (`AttnFuncWithCPAndQKVOA2A`): a rank holds s/cp tokens of its tp rank's heads;
    forward all-to-alls of Q, K, V then O, backward of dO then dQ, dK, dV, none beside
    the attention. allgather (`AttnFuncWithCPAndKVAllGather`): forward K and V gathered
    (whole sequence, the tp rank's K/V heads), backward gathered again and dK, dV
    reduce-scattered, none beside the attention."""
    kv_token = kv_heads * 64 * 2
    if kind == "a2a":
        query, key = seq / cp * Q_TOKEN / tp, seq / cp * kv_token / tp
        passes = [query, key, key, query]  # forward Q K V O; backward dO dQ dK dV alike
        each = sum(_all_to_all(nbytes, cp, tp, cluster) for nbytes in passes)
        return each, each
    whole = seq * kv_token / tp
    gather = _collective("gather", whole, cp, tp, cluster)
    scatter = _collective("scatter", whole, cp, tp, cluster)
    return 2 * gather, 2 * gather + 2 * scatter


def _costs(shape: str, kind: str, cp: int, tp: int, cluster: ClusterSpec,
           recompute: str = "none") -> tuple[StageCosts, list[int]]:
    """One sample's stage costs of `kind` at pp 2 and the blocks of each stage."""
    model = load_model(shape, precision="bf16", sequence_parallel=True)
    options = SearchOptions(**engine_options("megatron-core", cp_attention=kind))
    config = PlanConfig(pp=2, tp=tp, dp=cluster.num_devices // (2 * tp * cp), cp=cp,
                        schedule="1f1b", chunks=1, microbatch_size=1, num_microbatches=8,
                        zero_stage=0, recompute=recompute)
    table = _context(model, cluster, 8, None, options).table(config)
    assert table.cp_attention == kind and table.cp_stride == tp
    blocks = [sum(layer.shape is not None and layer.shape.role == "block" for layer in stage)
              for stage in table.stages]
    return table.costs(1), blocks


CASES = [  # shape, seq, cp, tp, nodes, nccl: NVLink, across nodes, NCCL's model or α–β
    (GQA, 1024, 2, 2, 1, True),
    (GQA, 1024, 4, 1, 1, False),
    (LONG, 8192, 4, 1, 2, True),    # cp 4 · tp 1 on one node, the rest dp
    (LONG, 8192, 2, 2, 1, False),
    (MHA, 8192, 4, 4, 2, True),     # cp · tp = 16: the cp group spans both nodes
    (MHA, 8192, 4, 4, 2, False),
]


def _check(kind: str, shape: str, seq: int, cp: int, tp: int, nodes: int, nccl: bool,
           recompute: str = "none") -> None:
    """`kind`'s cp_comm per stage equals the oracle's; where the ring shows nothing (its
    ops are compute alone), the forward's collectives land in F and the backward's (and a
    recomputed forward's) in the input-gradient op."""
    cluster = resolve_cluster("h100-80g", nodes=nodes)
    cluster = cluster if nccl else replace(cluster, nccl_arch="")
    costs, blocks = _costs(shape, kind, cp, tp, cluster, recompute)
    forward, backward = _oracle(kind, seq, cp, tp, cluster, 16 if shape == MHA else 4)
    again = 1 if recompute in ("full", "selective") else 0  # the attention forward again
    assert costs.cp_comm is not None
    assert costs.cp_comm.tolist() == pytest.approx(
        [n * ((1 + again) * forward + backward) for n in blocks], rel=1e-12)
    ring, _ = _costs(shape, "ring", cp, tp, cluster, recompute)
    assert ring.cp_comm is not None
    if ring.cp_comm.any():  # the ring shows through (1k tokens, or across nodes)
        assert shape == GQA or cp * tp > cluster.devices_per_node
        return
    assert (costs.forward - ring.forward).tolist() == pytest.approx(
        [n * forward for n in blocks], rel=1e-9)
    assert (costs.input_grad - ring.input_grad).tolist() == pytest.approx(
        [n * (backward + again * forward) for n in blocks], rel=1e-9)
    assert costs.weight_grad.tolist() == ring.weight_grad.tolist()


@pytest.mark.parametrize("kind", ["a2a", "kv-allgather"])
@pytest.mark.parametrize("shape, seq, cp, tp, nodes, nccl", CASES)
def test_cp_comm_equals_te_oracle(kind: str, shape: str, seq: int, cp: int, tp: int,
                                  nodes: int, nccl: bool) -> None:
    _check(kind, shape, seq, cp, tp, nodes, nccl)


@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("kind", ["a2a", "kv-allgather"])
def test_recomputed_attention_communicates_again(kind: str, recompute: str) -> None:
    """Full recomputation reruns the layer, selective its core attention (Megatron-Core's
    checkpoint around TE's DotProductAttention, the cp collectives inside): both again."""
    _check(kind, LONG, 8192, 2, 2, 1, True, recompute=recompute)


def test_nothing_hidden_where_the_ring_hides_everything() -> None:
    """At 8k tokens the ring's messages hide under the attention; a2a and allgather run
    beside none of it, so they show whole."""
    cluster = resolve_cluster("h100-80g", nodes=1)
    ring, _ = _costs(LONG, "ring", 2, 2, cluster)
    assert ring.cp_comm is not None and not ring.cp_comm.any()
    for kind in ("a2a", "kv-allgather"):
        costs, _ = _costs(LONG, kind, 2, 2, cluster)
        assert costs.cp_comm is not None and (costs.cp_comm > 0).all()


def _overlapped(layer, tp, cp, batch, cluster):  # type: ignore[no-untyped-def]
    """Planted: a2a priced as if beside this rank's attention (only the excess shown)."""
    forward, backward = context_comm.a2a_layer_seconds(layer, tp, cp, batch, cluster)
    attention = layer_selective_seconds(layer, cluster, "bf16", batch, tp) / cp
    return max(0.0, forward - attention), max(0.0, backward - 2 * attention)


def _kv_only(layer, tp, cp, batch, cluster):  # type: ignore[no-untyped-def]
    """Planted: a2a moving K and V only (no Q, no O)."""
    _, key = context_comm._local_bytes(layer, tp, cp)
    each = 2 * context_comm.all_to_all_seconds(key * batch, cp, tp, cluster)
    return each, each


def _no_scatter(layer, tp, cp, batch, cluster):  # type: ignore[no-untyped-def]
    """Planted: allgather forgetting the dK/dV reduce-scatter."""
    forward, _ = context_comm.kv_allgather_layer_seconds(layer, tp, cp, batch, cluster)
    return forward, forward


def _no_regather(layer, tp, cp, batch, cluster):  # type: ignore[no-untyped-def]
    """Planted: allgather keeping the gathered K/V for the backward (no second gather)."""
    forward, backward = context_comm.kv_allgather_layer_seconds(layer, tp, cp, batch,
                                                                cluster)
    return forward, backward - forward


@pytest.mark.parametrize("kind, planted", [("a2a", _overlapped), ("a2a", _kv_only),
                                           ("kv-allgather", _no_scatter),
                                           ("kv-allgather", _no_regather)])
def test_planted_bugs_fail_the_oracle(kind: str, planted: Callable[..., tuple[float, float]],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(context_comm._LAYER_SECONDS, kind, planted)
    with pytest.raises(AssertionError):
        _check(kind, LONG, 8192, 2, 2, 1, True)


def test_a2a_refuses_heads_per_tp_not_divisible_by_cp(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    # 4 K/V heads / tp 2 = 2 per tp rank: cp 4 cannot split them
    argv = ["plan", "--model", GQA, "--cluster", "h100-80g", "--global-batch", "8",
            "--engine", "megatron-core", "--cp-comm-type", "a2a"]
    assert main([*argv, "--price", "pp1,tp2,cp4,1f1b,b1"]) == 2
    err = capsys.readouterr().err
    assert "key/value heads 4 / tp 2 = 2 not divisible by 4" in err, err
    assert main([*argv, "--cp", "4", "--tp", "2"]) == 2
    assert "--cp-comm-type a2a" in capsys.readouterr().err
    assert main([*argv, "--cp", "8"]) == 2  # no tp leaves 4 K/V heads divisible by 8
    assert "at every tp searched" in capsys.readouterr().err
    # tp 1 at cp 4 runs but pp 8 leaves it no devices: the skipped pairs are named
    assert main([*argv, "--cp", "4", "--pp", "8"]) == 2
    assert "the heads (and key/value heads) per tp rank must divide by cp" in \
        capsys.readouterr().err


def test_a2a_search_skips_the_pairs_it_cannot_run() -> None:
    """Without --tp the search drops each (tp, cp) whose heads per tp rank cp does not
    divide (tp 2 at cp 4), keeping the others (tp 1 at cp 4), and counts them."""
    model = load_model(GQA, precision="bf16", sequence_parallel=True)
    cluster = resolve_cluster("h100-80g", nodes=1)
    options = SearchOptions(**engine_options("megatron-core", cp_attention="a2a"),
                            context_parallel=(4,), top=50, prune=False)
    result = plan(model, cluster, 8, options=options)
    pairs = {(p.config.tp, p.config.cp) for p in result.predictions}
    assert (1, 4) in pairs and all(4 % (tp * cp) == 0 for tp, cp in pairs), pairs
    ring = plan(model, cluster, 8, options=replace(options, cp_attention="ring"))
    assert (2, 4) in {(p.config.tp, p.config.cp) for p in ring.predictions}
    with pytest.raises(PlanError, match="must be one of"):
        SearchOptions(cp_attention="ulysses")


@pytest.mark.parametrize("flag", ["p2p", "a2a", "allgather"])
def test_launch_line_carries_the_type(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", GQA, "--cluster", "h100-80g", "--global-batch", "8",
            "--engine", "megatron-core", "--cp-comm-type", flag]
    assert main([*argv, "--price", "pp2,tp2,cp2,1f1b,b1"]) == 0
    out = capsys.readouterr().out
    assert f"--context-parallel-size 2 --cp-comm-type {flag} " in out, out
    assert main([*argv, "--cp", "2", "--pp", "2", "--tp", "2", "--top", "1"]) == 0
    assert f"--cp-comm-type {flag} " in capsys.readouterr().out


def test_p2p_is_the_default_and_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", GQA, "--cluster", "h100-80g", "--global-batch", "8",
            "--engine", "megatron-core", "--json", "--price", "pp2,tp2,cp2,1f1b,b1"]
    prices = []
    for extra in ([], ["--cp-comm-type", "p2p"], ["--cp-comm-type", "a2a"]):
        assert main([*argv, *extra]) == 0
        prices.append(json.loads(capsys.readouterr().out)["step_seconds"])
    assert prices[0] == prices[1] != prices[2]


def test_other_engines_refuse_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for engine in ("pipesched", "deepspeed"):
        assert main(["plan", "--model", GQA, "--cluster", "h100-80g", "--global-batch", "8",
                     "--engine", engine, "--cp-comm-type", "p2p", "--price",
                     "pp2,tp2,cp2,1f1b,b1"]) == 2
        err = capsys.readouterr().err
        assert "--cp-comm-type p2p is Megatron-Core's" in err and engine in err, err


def test_the_docs_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/planner.md's "Megatron-Core's a2a and allgather" table, as printed."""
    shape = ("layers=80,hidden=8192,heads=64,kv_heads=8,ffn=28672,vocab=128256,seq=131072,"
             "mlp=swiglu,norm=rmsnorm,bias=none")
    figures = {}
    for flag in ("p2p", "a2a", "allgather"):
        assert main(["plan", "--model", shape, "--cluster", "h100-80g", "--nodes", "16",
                     "--global-batch", "32", "--engine", "megatron-core", "--cp-comm-type",
                     flag, "--price", "pp8,tp2,cp4,dp2,1f1b,b1,z1,rc", "--json"]) == 0
        priced = json.loads(capsys.readouterr().out)
        figures[flag] = (round(priced["step_seconds"], 2),
                         round(priced["breakdown"]["cp_comm"] * 1e3, 1))
    assert figures == {"p2p": (244.48, 0.0), "a2a": (245.36, 613.6),
                       "allgather": (245.03, 381.7)}, figures
