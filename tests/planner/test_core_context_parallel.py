"""`--engine megatron-core` searches and prices context parallelism as Transformer Engine's
ring (--cp-comm-type p2p): an oracle of its steps, the printed flags, pruning unchanged."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from pipeline.cli import main
from pipeline.planner import PRESETS, PlanConfig, SearchOptions, load_model, plan, resolve_cluster
from pipeline.planner.cluster import ClusterSpec
from pipeline.planner.engines import engine_options
from pipeline.planner.kernels import attention_core_seconds
from pipeline.planner.pricing import p2p_link
from pipeline.planner.search import _context

__all__: list[str] = []

GQA = ("layers=8,hidden=1024,heads=16,kv_heads=4,vocab=32000,seq=1024,mlp=swiglu,"
       "norm=rmsnorm,bias=none")
LONG = ("layers=4,hidden=1024,heads=16,kv_heads=4,vocab=32000,seq=8192,mlp=swiglu,"
        "norm=rmsnorm,bias=none")


def _steps(messages: list[float], compute: float, span: int, cluster: ClusterSpec) -> float:
    """The seconds a ring's messages add to its steps, walked one step at a time: step i
    launches message i (bytes; 0: none) and runs `compute`; the next step starts when both
    are done (Transformer Engine's AttnFuncWithCPAndKVP2P waits on the receive)."""
    clock = 0.0
    for nbytes in messages:
        arrival = clock
        if nbytes:
            bandwidth, latency = p2p_link(cluster, span, nbytes)
            arrival = clock + latency + nbytes / bandwidth
        clock = max(clock + compute, arrival)
    return clock - len(messages) * compute


def _oracle(model: str, cp: int, tp: int, cluster: ClusterSpec, layers: int,
            recomputed: bool) -> float:
    """cp_comm of one stage of `layers` blocks of `model` (GQA or LONG, 4 kv heads of 64),
    one sample a microbatch, from the definition: each rank holds its s/cp tokens' K and V
    (2 · s/cp · 4 · 64 · 2 bytes / tp); the
    forward passes them on at steps 0..cp−2; the backward sends K/V at step 0, K/V with the
    dK/dV so far (twice the bytes) at steps 1..cp−2, dK/dV at step cp−1; each step's
    attention is 1/cp² of the layer's (twice that backward); cp neighbours tp ranks apart."""
    shape = load_model(model, precision="bf16").layers[1].shape
    assert shape is not None and shape.role == "block"
    kv = 2 * shape.seq / cp * (4 * 64) * 2 / tp
    step = attention_core_seconds(shape, 1, tp, cluster, "bf16") / cp**2
    forward = _steps([kv] * (cp - 1) + [0.0], step, cp * tp, cluster)
    backward = _steps([kv] + [2 * kv] * (cp - 2) + [kv], 2 * step, cp * tp, cluster)
    return layers * (forward * (2 if recomputed else 1) + backward)


@pytest.mark.parametrize("shape, cp, tp, nodes, recompute, hidden", [
    (GQA, 4, 2, 2, "none", False),   # NVLink, short sequences: partly exposed
    (LONG, 4, 2, 2, "none", True),   # 8k tokens: the attention hides every message
    (LONG, 4, 4, 4, "none", False),  # the ring crosses nodes (cp · tp = 16 > 8)
    (GQA, 2, 2, 1, "full", False),   # recomputed forwards run the ring again
    (GQA, 2, 2, 1, "selective", False),  # so does the core_attn checkpoint around TE's ring
])
def test_ring_cp_comm_equals_a_step_by_step_oracle(shape: str, cp: int, tp: int, nodes: int,
                                                  recompute: str, hidden: bool) -> None:
    model = load_model(shape, precision="bf16", sequence_parallel=True)
    cluster = resolve_cluster("h100-80g", nodes=nodes)
    assert cluster.sm_count > 0  # the kernel model prices the attention core
    options = SearchOptions(**engine_options("megatron-core"))
    assert options.cp_attention == "ring"
    context = _context(model, cluster, 8, None, options)
    config = PlanConfig(pp=2, tp=tp, dp=cluster.num_devices // (2 * tp * cp), cp=cp,
                        schedule="1f1b", chunks=1, microbatch_size=1, num_microbatches=8,
                        zero_stage=0,
                        recompute=recompute)
    table = context.table(config)
    assert table.cp_attention == "ring" and table.cp_stride == tp
    costs = table.costs(1)
    assert costs.cp_comm is not None
    blocks = [sum(layer.shape is not None and layer.shape.role == "block" for layer in stage)
              for stage in table.stages]
    expected = [_oracle(shape, cp, tp, cluster, n, recompute != "none") for n in blocks]
    assert costs.cp_comm.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert all((value == 0) == hidden for value in expected), expected


def test_ring_hides_what_the_attention_covers() -> None:
    """The ring exposes less than its messages sent back to back without the attention."""
    model = load_model(GQA, precision="bf16", sequence_parallel=True)
    cluster = resolve_cluster("h100-80g", nodes=1)
    options = SearchOptions(**engine_options("megatron-core"))
    config = PlanConfig(pp=2, tp=2, dp=1, cp=2, schedule="1f1b", chunks=1,
                        microbatch_size=1, num_microbatches=8, zero_stage=0, recompute="none")
    kv = 2 * 1024 / 2 * 256 * 2 / 2
    bandwidth, latency = p2p_link(cluster, 4, kv)
    sent = 4 * 3 * (latency + kv / bandwidth)  # 4 blocks: 1 forward message, 2 backward
    ring = _context(model, cluster, 8, None, options).table(config).costs(1).cp_comm
    assert ring is not None and all(0 < ring) and all(ring < sent), (ring, sent)


def test_megatron_core_searches_cp_and_prints_its_flags(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    argv = ["plan", "--model", GQA, "--cluster", "h100-80g", "--global-batch", "8",
            "--engine", "megatron-core", "--cp", "2", "--pp", "2", "--tp", "2"]
    assert main([*argv, "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "cp2" in out and "--context-parallel-size 2 --cp-comm-type p2p" in out, out
    assert main([*argv, "--json"]) == 0
    pick = json.loads(capsys.readouterr().out)["pick"]
    assert pick["config"]["cp"] == 2 and pick["breakdown"]["cp_comm"] > 0
    label = ",".join(item for item in pick["config"]["label"].split()
                     if not re.fullmatch(r"m\d+", item))  # m follows from the batch
    assert main(["plan", "--model", GQA, "--cluster", "h100-80g", "--global-batch", "8",
                 "--engine", "megatron-core", "--json", "--price", label]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert priced["step_seconds"] == pick["step_seconds"]


def test_engines_without_cp_still_refuse_it(capsys: pytest.CaptureFixture[str]) -> None:
    for engine in ("deepspeed", "megatron-2021"):
        assert main(["plan", "--model", GQA, "--cluster", "h100-80g", "--global-batch", "8",
                     "--engine", engine, "--price", "pp2,tp2,cp2,1f1b,b1"]) == 2
        err = capsys.readouterr().err
        assert "context parallelism" in err and "outside" in err, err


def test_pruned_search_equals_unpruned_with_megatron_core_cp() -> None:
    model = load_model(GQA, precision="bf16", sequence_parallel=True)
    cluster = replace(PRESETS["a100-80g"], nodes=2, devices_per_node=4,
                      device_memory=6.0 * 2**30)
    options = SearchOptions(**engine_options("megatron-core"), context_parallel=(1, 2, 4),
                            top=4)
    pruned = plan(model, cluster, 8, options=options)
    unpruned = plan(model, cluster, 8, options=replace(options, prune=False))

    def rows(predictions: list) -> list[tuple]:  # type: ignore[type-arg]
        return [(p.config.label(), p.step_seconds, p.memory.total) for p in predictions]

    assert {p.config.cp for p in unpruned.predictions} >= {1, 2}
    assert rows(pruned.predictions[:4]) == rows(unpruned.predictions[:4])
    assert rows(pruned.pareto()) == rows(unpruned.pareto())
