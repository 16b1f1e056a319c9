"""The planner prices the data-parallel reduction by the simulator's rule, which is the engine's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.planner.cluster import PRESETS
from pipeline.planner.predict import PlanConfig
from pipeline.planner.search import price
from pipeline.planner.shape_parse import parse_shape
from pipeline.planner.transformer_layers import transformer_profile

__all__: list[str] = []

MODEL = transformer_profile(parse_shape("layers=24,hidden=2304,heads=24,vocab=51200,seq=2048"))
CLUSTER = replace(PRESETS["a100-80g"], nodes=4)


def _dp_comm(schedule: str, pp: int, zero: int, overlap: bool) -> tuple[float, float]:
    dp = 32 // pp
    config = PlanConfig(pp=pp, tp=1, dp=dp, schedule=schedule, chunks=1, microbatch_size=4,
                        num_microbatches=512 // dp // 4, zero_stage=zero, recompute="none")
    prediction = price(MODEL, CLUSTER, 512, config, overlap_grad_reduce=overlap)
    return prediction.breakdown["dp_comm"], prediction.breakdown["compute"]


def test_split_backward_reduction_is_priced_unhidden_as_the_engine_runs_it() -> None:
    # the engine's hooks skip a stage whose last backward is a split W (zb-h1): it reduces
    # at REDUCE_GRAD, after that W; the planner once hid it behind the W
    assert _dp_comm("zb-h1", 4, 0, True)[0] == pytest.approx(_dp_comm("zb-h1", 4, 0, False)[0])
    assert _dp_comm("1f1b", 4, 0, True)[0] < 0.5 * _dp_comm("1f1b", 4, 0, False)[0]


def test_zero1_reduction_hides_behind_the_whole_last_backward_as_plain_dp() -> None:
    # the engine shards each ZeRO-1 bucket d ways, so a bucket is final when the same bucket
    # of a plain all-reduce is: what hides is the same share of the last backward (a
    # backward under compute / m); the planner once hid it behind the last 1/d only
    zero, compute = _dp_comm("1f1b", 1, 1, True)
    zero_after, _ = _dp_comm("1f1b", 1, 1, False)
    m, d = 512 // 32 // 4, 32
    assert compute / m / d < zero_after - zero <= compute / m
