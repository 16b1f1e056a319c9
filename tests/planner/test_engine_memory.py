"""Another engine's memory in the planner: Megatron-LM 2021's torch DDP buckets at p = 1 and
fp32 gradient copies at the optimizer step, against counts written here from its code."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.planner import PRESETS, PlanConfig, SearchOptions, parse_shape
from pipeline.planner.engines import ENGINES
from pipeline.planner.predict import PlanContext
from pipeline.planner.search import price
from pipeline.planner.transformer_layers import transformer_profile

__all__: list[str] = []

MODEL = transformer_profile(parse_shape("layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"),
                            "fp16", attention="eager")
CLUSTER = replace(PRESETS["a100-80g"], nodes=1)
MEGATRON = SearchOptions(**ENGINES["megatron-2021"])  # the engine --engine megatron-2021 prices


def _config(pp: int, microbatch: int) -> PlanConfig:
    return PlanConfig(pp=pp, tp=1, dp=8 // pp, schedule="1f1b", chunks=1,
                      microbatch_size=microbatch, num_microbatches=32 // (8 // pp) // microbatch,
                      zero_stage=0, recompute="full")


@pytest.mark.parametrize("microbatch", [1, 4])
def test_megatron_2021_holds_its_ddp_buckets_and_step_copies(microbatch: int) -> None:
    # p = 1, torch DDP: fp16 weights 2 + fp16 gradients 2 + fp32 master 4 + Adam 8 = 16,
    # DDP's bucket copy of the fp16 gradients 2 through the step; at the optimizer step
    # fp32 copies of the gradients, 4 more, when no activation is left:
    # peak = max(18P + activations, 22P)
    plain = price(MODEL, CLUSTER, 32, _config(1, microbatch), precision="fp16",
                  options=replace(MEGATRON, step_gradient_bytes=0.0,
                                  overlap_grad_reduce_unpipelined=False))
    params = plain.memory.parameters / 4
    acts = plain.memory.activations
    found = price(MODEL, CLUSTER, 32, _config(1, microbatch), precision="fp16",
                  options=MEGATRON)
    # the runtime's NCCL buffers and cuBLAS workspaces (`runtime_memory`) come on top
    assert found.memory.total - found.memory.runtime == pytest.approx(
        max(18 * params + acts, 22 * params))
    # p = 2, Megatron's local DDP: no bucket copy through the pipeline; the fullest rank's
    # peak is max over ranks r of max(16P_r + A_r, 20P_r) = max(the plain peak, 20 max P_r)
    plain2 = price(MODEL, CLUSTER, 32, _config(2, microbatch), precision="fp16",
                   options=replace(MEGATRON, step_gradient_bytes=0.0))
    found2 = price(MODEL, CLUSTER, 32, _config(2, microbatch), precision="fp16",
                   options=MEGATRON)
    context = PlanContext(MODEL, CLUSTER, 32, "fp16", uniform_layers=True)
    most = float(context.rank_sums(_config(2, microbatch))[0].max())
    runtime = found2.memory.runtime
    assert runtime == plain2.memory.runtime > 0
    assert found2.memory.total - runtime == pytest.approx(
        max(plain2.memory.total - runtime, 20 * most))


def test_the_ddp_bucket_is_only_where_torch_ddp_runs() -> None:
    context = PlanContext(MODEL, CLUSTER, 32, "fp16", overlap_grad_reduce=False,
                          overlap_grad_reduce_unpipelined=True, grad_reduce_bytes=2.0)
    assert context.engine_bytes(_config(1, 4))["extra_gradient_bytes"] == 2.0
    assert context.engine_bytes(_config(2, 4))["extra_gradient_bytes"] == 0.0
    ours = PlanContext(MODEL, CLUSTER, 32, "fp16")  # this engine: its own gradient buffer
    assert ours.engine_bytes(_config(1, 4))["extra_gradient_bytes"] == 0.0


def test_megatron_2021_steps_over_its_mixed_precision_traffic() -> None:
    # Oracle from its optimizer's step, bytes per parameter: fp16 gradients to fp32 (2 + 4),
    # unscale and inf check (4 + 4), the norm (4), fused Adam (16 read + 12 written), fp32
    # weights back to fp16 (4 + 2); this engine's fp32 Adam: the 28 alone.
    megatron = sum((2 + 4, 4 + 4, 4, 16 + 12, 4 + 2))
    for options, per_param in ((MEGATRON, megatron), (SearchOptions(), 28)):
        context = PlanContext(MODEL, CLUSTER, 32, "fp16", update_bytes=options.update_bytes,
                              uniform_layers=True)
        config = _config(2, 4)
        params = context.rank_sums(config)[0]
        step = context.update_seconds(config)[0]
        assert step == pytest.approx(CLUSTER.op_overhead + params * per_param
                                     / CLUSTER.memory_bandwidth)
    # and through the search options into a priced step
    found = price(MODEL, CLUSTER, 32, _config(1, 4), precision="fp16", options=MEGATRON)
    plain = price(MODEL, CLUSTER, 32, _config(1, 4), precision="fp16",
                  options=replace(MEGATRON, update_bytes=28.0))
    moved = (found.breakdown["optimizer"] - CLUSTER.op_overhead) / (
        plain.breakdown["optimizer"] - CLUSTER.op_overhead)
    assert moved == pytest.approx(megatron / 28)
