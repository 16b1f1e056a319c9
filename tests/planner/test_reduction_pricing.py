"""The planner prices the data-parallel reduction by the simulator's rule, which is the engine's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.planner.cluster import PRESETS
from pipeline.planner.predict import PlanConfig
from pipeline.planner.search import price
from pipeline.planner.transformer import parse_shape, transformer_profile

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


def test_zero1_reduction_hides_behind_the_last_1_over_d_of_the_backward_only() -> None:
    # ZeRO-1's buckets are final only in the last 1/d of the last backward (a bucket holds
    # the same slice of every shard): at most that much of the reduction hides, and that
    # backward is under compute / m. The planner once hid it behind the whole backward.
    overlapped, compute = _dp_comm("1f1b", 1, 1, True)
    after, _ = _dp_comm("1f1b", 1, 1, False)
    m, d = 512 // 32 // 4, 32
    assert 0 < after - overlapped <= compute / m / d
