"""Tensor × expert parallelism in the planner (issue 43 item 4, issue 48 item 4): attention
and the dense layers split over tp, the experts over ep only (expert tensor parallelism 1,
as Megatron-Core), each tp rank's s/t tokens through the all-to-all under sequence
parallelism. Each price against its definition written here; the search and a published
MoE layout (Mixtral-8x22B at tp4 × ep2) within it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import pipeline.planner.grid as grid
from pipeline.planner import PRESETS, PlanConfig, PlanError, SearchOptions, load_model, plan
from pipeline.planner.data_parallel import grad_reduction
from pipeline.planner.engines import engine_options
from pipeline.planner.expert_kernels import expert_gemm_times
from pipeline.planner.expert_parallel import expert_all_to_all
from pipeline.planner.kernels import block_linear_times
from pipeline.planner.predict import PlanContext
from pipeline.planner.pricing import allreduce_seconds, layer_tp_seconds, reduce_scatter_seconds
from pipeline.planner.routing_load import busiest_rank_ratio
from pipeline.planner.search import price

__all__: list[str] = []

H100 = PRESETS["h100-80g"]
MOE = ("layers=8,hidden=1024,heads=8,vocab=1000,seq=512,mlp=swiglu,norm=rmsnorm,bias=none,"
       "learned_positions=false,ffn=4096,experts=8,topk=2,expert_ffn=4096")
MIXTRAL_8X22B = ("layers=56,hidden=6144,heads=48,kv_heads=8,vocab=32768,seq=4096,mlp=swiglu,"
                 "norm=rmsnorm,bias=none,learned_positions=false,ffn=16384,experts=8,topk=2,"
                 "expert_ffn=16384,dropout=false")
"""Mixtral-8x22B's HF config (141B parameters), at sequences of 4096."""


def _config(tp: int, ep: int, dp: int = 4, pp: int = 1, zero: int = 0) -> PlanConfig:
    return PlanConfig(pp=pp, tp=tp, dp=dp, schedule="1f1b", chunks=1, microbatch_size=2,
                      num_microbatches=4, zero_stage=zero, recompute="none", ep=ep)


def _one_all_to_all(nbytes: float, ep: int, stride: int, cluster: Any) -> float:
    """By its definition: nbytes / ep to each of ep - 1 peers at once; the peers on the
    rank's node (the ep members `stride` apart that fit in it) over NVLink, the rest over
    its share of the node's network cards."""
    local = min(ep, cluster.devices_per_node // stride)
    times = []
    if local > 1:
        times.append(cluster.intra_latency + (local - 1) * nbytes / ep
                     / (cluster.intra_bandwidth * cluster.link_efficiency))
    if ep > local:
        share = cluster.nics_per_node * cluster.nic_bandwidth / cluster.devices_per_node
        times.append(cluster.inter_latency + (ep - local) * nbytes / ep
                     / (share * cluster.link_efficiency))
    return max(times)


@pytest.mark.parametrize(("tp", "ep", "per_node"), [(2, 2, 8), (2, 4, 8), (4, 2, 4)])
def test_all_to_all_sends_the_tp_ranks_sequence_slice_over_its_ep_group(
        tp: int, ep: int, per_node: int) -> None:
    cluster = replace(H100, nodes=16 // per_node, devices_per_node=per_node)
    model = load_model(MOE, sequence_parallel=True)
    config = _config(tp, ep, dp=16 // tp)
    table = PlanContext(model, cluster, 64, "bf16").table(config)
    found = expert_all_to_all(table, cluster, batch=2, ep=ep, tp=tp)
    assert found is not None
    # per MoE layer and microbatch: the rank's s/t tokens' k copies of h bf16 values, out
    # and back, the busiest of the t ep groups' ranks taking its share (every block is a
    # MoE one)
    nbytes = 2 * (512 // tp) * 2 * 1024 * 2 * busiest_rank_ratio(2 * 512 // tp, 2, 8, ep, tp)
    assert np.allclose(found.forward, [8 * 2 * _one_all_to_all(nbytes, ep, tp, cluster)],
                       rtol=1e-12)


def test_a_moe_block_splits_attention_over_tp_and_keeps_its_experts_whole() -> None:
    model = load_model(MOE, sequence_parallel=True)
    moe = model.layers[1]
    assert moe.expert_params == 8 * 3 * 1024 * 4096
    # attention's parameters split over t, the experts' not (held per ep: `memory`)
    assert moe.params_split == 1024 * 3 * 1024 + 1024 * 1024
    # attention's collectives only: one all-reduce's bytes a pass, none around the MLP
    assert layer_tp_seconds(moe, H100, 2, 4) == pytest.approx(
        allreduce_seconds(2 * 512 * 1024 * 2, 4, 1, H100), rel=1e-12)
    assert moe.shape is not None
    kinds = [kind for kind, _ in block_linear_times(moe.shape, 2, 4, H100, "bf16")]
    assert kinds == ["column", "row"]  # the MLP's GEMMs: `expert_kernels`, no collective
    # the experts' GEMMs: the rank's s·b/t tokens, whatever t's share
    assert expert_gemm_times(moe.shape, 2, 4, H100, "bf16") == \
        expert_gemm_times(replace(moe.shape, seq=512 // 4), 2, 1, H100, "bf16")


@pytest.mark.parametrize("rule", ["tp_rank", "megatron"])
@pytest.mark.parametrize(("tp", "ep", "zero"), [(2, 2, 0), (2, 4, 1), (4, 2, 1), (2, 1, 1)])
def test_memory_holds_dense_over_tp_and_experts_over_ep(tp: int, ep: int, zero: int,
                                                        rule: str) -> None:
    model = load_model(MOE, sequence_parallel=True)
    context = PlanContext(model, H100, 64, "bf16", expert_grad_group=rule)
    config = _config(tp, ep, dp=8 // tp, zero=zero)
    memory, _ = context.memory(config, context.held_trace(config))
    dense = sum(layer.params(tp) for layer in model.layers)
    experts = sum(layer.expert_params for layer in model.layers) / ep
    dp = 8 // tp
    # this engine's fp32 states: weight 4, gradient 4, Adam 8 (sharded under ZeRO-1 over
    # dp for the dense part; for the experts over the dp / ep ranks of one tp rank, this
    # engine's expert group, or Megatron-Core's t·dp / ep ranks holding the same experts)
    group = dp // ep if rule == "tp_rank" else tp * dp // ep
    assert memory.parameters == pytest.approx(4 * (dense + experts), rel=1e-12)
    assert memory.optimizer == pytest.approx(
        8 * dense / (dp if zero else 1) + 8 * experts / (group if zero else 1), rel=1e-12)


def test_expert_gradients_reduce_over_the_ranks_holding_the_same_experts() -> None:
    cluster = replace(H100, nodes=2)
    model = load_model(MOE, sequence_parallel=True)
    config = _config(2, 2, dp=8, zero=1)
    table = PlanContext(model, cluster, 64, "bf16").table(config)
    found = grad_reduction(table, cluster, dp=8, tp=2, zero_stage=1, grad_reduce_bytes=4,
                           overlap=True, ep=2)
    assert found is not None
    # members of one expert group: the 2 tp ranks of the 4 replicas with the same ep rank,
    # in runs of 2, 4 apart: 8 ranks, 4 of them on each 8-device node
    group = [r for r in range(16) if (r // 2) % 2 == 0]
    assert len(group) == 8 and sum(r < 8 for r in group) == 4
    expected = [reduce_scatter_seconds(4 * dense, 8, 2, cluster)
                + (reduce_scatter_seconds(4 * experts / 2, 8, 2, cluster) if experts else 0.0)
                for dense, experts in zip(table.params, table.experts, strict=True)]
    assert np.allclose(found.time, expected, rtol=1e-12)
    # dp 1 at tp 2: the experts, whole on both tp ranks, are still reduced over them
    alone = grad_reduction(table, cluster, dp=1, tp=2, zero_stage=0, grad_reduce_bytes=4,
                           overlap=True, ep=1)
    assert alone is not None and max(alone.time) > 0


def test_tp_with_experts_needs_sequence_parallelism() -> None:
    cluster = replace(H100, nodes=1)
    plain = [c.tp for c in grid.configurations(load_model(MOE), cluster, 16,
                                                SearchOptions(schedules=("1f1b",)))]
    assert set(plain) == {1}
    split = [(c.tp, c.ep) for c in grid.configurations(
        load_model(MOE, sequence_parallel=True), cluster, 16, SearchOptions(
            schedules=("1f1b",)))]
    assert any(tp > 1 and ep > 1 for tp, ep in split)
    with pytest.raises(PlanError, match="with sequence parallelism only"):
        plan(load_model(MOE), cluster, 16, options=SearchOptions(tensor_parallel=(2,)))


def _mixtral(engine: str) -> tuple[Any, Any, SearchOptions]:
    profile = {"sequence_parallel": True}
    model = load_model(MIXTRAL_8X22B, **profile)
    cluster = replace(H100, nodes=16)
    options = SearchOptions(**engine_options(engine, schedules=("1f1b",),
                                             recompute_choices=("none", "selective")))
    return model, cluster, options


@pytest.mark.parametrize("engine", ["megatron-core", "pipesched"])
def test_mixtral_8x22b_on_128_h100_picks_tp_and_ep(engine: str) -> None:
    model, cluster, options = _mixtral(engine)
    result = plan(model, cluster, 256, options=options)
    best = result.best
    assert best.config.tp > 1 and best.config.ep > 1, best.config.label()
    parts = best.breakdown
    assert sum(parts.values()) == pytest.approx(best.step_seconds, rel=1e-9)
    assert parts["tp_comm"] > 0 and parts["ep_comm"] > 0
    assert parts["compute"] > 0.5 * best.step_seconds


def test_mixtral_8x22b_published_layout_is_searched_and_fits_megatron_core() -> None:
    model, cluster, options = _mixtral("megatron-core")
    best = plan(model, cluster, 256, options=options).best
    # the published layout (tp4 × ep2, issue 43) is in the search's grid, and fits
    published = [c for c in grid.configurations(model, cluster, 256, options)
                 if (c.tp, c.ep, c.pp) == (4, 2, 8)]
    assert published
    priced = price(model, cluster, 256, replace(published[0], microbatch_size=1,
                                                num_microbatches=64, zero_stage=1,
                                                recompute="none"), options=options)
    assert priced.memory.total <= cluster.device_memory
    assert priced.step_seconds <= 1.2 * best.step_seconds
