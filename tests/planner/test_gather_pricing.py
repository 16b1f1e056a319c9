"""The planner prices ZeRO-1's overlapped parameter all-gather by the simulator's rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipeline.planner.cluster import PRESETS
from pipeline.planner.predict import PlanConfig, PlanContext, Prediction
from pipeline.planner.search import SearchOptions, price
from pipeline.planner.shape_parse import parse_shape
from pipeline.planner.transformer_layers import transformer_profile

__all__: list[str] = []

MODEL = transformer_profile(parse_shape("layers=24,hidden=2304,heads=24,vocab=51200,seq=2048"))
CLUSTER = replace(PRESETS["a100-80g"], nodes=4)
CONFIGS = [("1f1b", 1, 1), ("1f1b", 4, 1), ("interleaved", 4, 2), ("zb-h1", 4, 1),
           ("zb-v", 4, 2), ("gpipe", 8, 1)]


def _price(schedule: str, pp: int, chunks: int, zero: int, overlap: bool) -> Prediction:
    dp = 32 // pp
    config = PlanConfig(pp=pp, tp=1, dp=dp, schedule=schedule, chunks=chunks,
                        microbatch_size=4, num_microbatches=512 // dp // 4, zero_stage=zero,
                        recompute="none")
    return price(MODEL, CLUSTER, 512, config,
                 options=SearchOptions(overlap_param_gather=overlap))


@pytest.mark.parametrize(("schedule", "pp", "chunks"), CONFIGS)
def test_overlapped_param_gather_is_never_slower_and_faster_where_it_was_exposed(
        schedule: str, pp: int, chunks: int) -> None:
    blocking = _price(schedule, pp, chunks, 1, False)
    overlapped = _price(schedule, pp, chunks, 1, True)
    # blocking, every ZeRO-1 step ends with its whole all-gather (dp = 32 / pp > 1): exposed
    assert overlapped.step_seconds < blocking.step_seconds
    assert overlapped.breakdown["dp_comm"] < blocking.breakdown["dp_comm"]
    # the parts still sum to the step
    assert sum(overlapped.breakdown.values()) == pytest.approx(overlapped.step_seconds)
    # without ZeRO there is no gather: the switch changes nothing
    assert _price(schedule, pp, chunks, 0, True).step_seconds == \
        _price(schedule, pp, chunks, 0, False).step_seconds


def test_overlapped_gather_still_waits_for_the_first_bucket_at_p1() -> None:
    # one stage per rank, nothing before its first forward: it waits for its first layers'
    # buckets (an overlapped gather priced as free would leave only the reduction exposed)
    blocking, overlapped = _price("1f1b", 1, 1, 1, False), _price("1f1b", 1, 1, 1, True)
    gather = float(PlanContext(MODEL, CLUSTER, 512, CLUSTER.precision).update_seconds(
        blocking.config)[1][0])
    reduction = blocking.breakdown["dp_comm"] - gather
    assert gather > 0
    assert reduction < overlapped.breakdown["dp_comm"] < reduction + gather
