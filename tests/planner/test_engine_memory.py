"""Another engine's memory in the planner: Megatron-LM 2021's torch DDP buckets at p = 1 and
fp32 gradient copies at the optimizer step, against counts written here from its code."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.planner import PRESETS, PlanConfig, SearchOptions, parse_shape
from pipeline.planner.predict import PlanContext
from pipeline.planner.search import price
from pipeline.planner.transformer import transformer_profile

__all__: list[str] = []

MODEL = transformer_profile(parse_shape("layers=8,hidden=1024,heads=16,vocab=32000,seq=1024"),
                            "fp16", attention="eager")
CLUSTER = replace(PRESETS["a100-80g"], nodes=1)
MEGATRON = SearchOptions(schedules=("1f1b",), uniform_layers=True, overlap_grad_reduce=False,
                         overlap_grad_reduce_unpipelined=True, grad_reduce_bytes=2.0,
                         step_gradient_bytes=4.0)


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
    assert found.memory.total == pytest.approx(max(18 * params + acts, 22 * params))
    # p = 2, Megatron's local DDP: no bucket copy through the pipeline; the fullest rank's
    # peak is max over ranks r of max(16P_r + A_r, 20P_r) = max(the plain peak, 20 max P_r)
    plain2 = price(MODEL, CLUSTER, 32, _config(2, microbatch), precision="fp16",
                   options=replace(MEGATRON, step_gradient_bytes=0.0))
    found2 = price(MODEL, CLUSTER, 32, _config(2, microbatch), precision="fp16",
                   options=MEGATRON)
    context = PlanContext(MODEL, CLUSTER, 32, "fp16", uniform_layers=True)
    most = float(context.rank_sums(_config(2, microbatch))[0].max())
    assert found2.memory.total == pytest.approx(max(plain2.memory.total, 20 * most))


def test_the_ddp_bucket_is_only_where_torch_ddp_runs() -> None:
    context = PlanContext(MODEL, CLUSTER, 32, "fp16", overlap_grad_reduce=False,
                          overlap_grad_reduce_unpipelined=True, grad_reduce_bytes=2.0)
    assert context.engine_bytes(_config(1, 4))["extra_gradient_bytes"] == 2.0
    assert context.engine_bytes(_config(2, 4))["extra_gradient_bytes"] == 0.0
    ours = PlanContext(MODEL, CLUSTER, 32, "fp16")  # this engine: its own gradient buffer
    assert ours.engine_bytes(_config(1, 4))["extra_gradient_bytes"] == 0.0
