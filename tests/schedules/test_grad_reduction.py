"""The simulated data-parallel gradient reduction: oracles by hand, properties, planted bugs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedules.analysis.reduction as reduction_module
import schedules.analysis.simulate as simulate_module
from schedules import (
    CostModel,
    GradReduction,
    Kind,
    Schedule,
    ScheduleConfigError,
    build_schedule,
    figures,
    simulate,
)
from schedules.analysis.reduction import Lane, StageLaunch, ring_reduction_time

# F = 1, B = 1, W = 1: a fused B costs 2 (the simulator's convention: backward + weight)
UNIT = CostModel(forward=1.0, backward=1.0, weight=1.0)


def _exposed(schedule: Schedule, time: float, buckets: int, start: str = "overlap",
             ) -> tuple[float, ...]:
    """The step and each rank's exposed reduction."""
    costs = CostModel(forward=1.0, backward=1.0, weight=1.0, reduction=GradReduction(
        time=time, buckets=buckets, start=start))  # type: ignore[arg-type]
    result = figures(simulate(schedule, costs))
    assert result.step is not None
    return (result.step, *result.exposed_reduction)


# -- oracles, worked out by hand from the definition (module docstring of the rule) ---------

def check_one_rank_oracle() -> None:
    """1F1B, p = 1, m = 2: F0 [0,1], B0 [1,3], F1 [3,4], B1 [4,6]; compute ends at 6.
    A reduction of R = 4 in k = 4 buckets of 1 each."""
    schedule = build_schedule("1f1b", 1, 2)
    # after the backward: all four at 6, one after another: ends at 10
    assert _exposed(schedule, 4.0, 4, "after_backward") == pytest.approx((10.0, 4.0))
    # plain overlap: final at 4.5, 5, 5.5, 6 -> [4.5,5.5] [5.5,6.5] [6.5,7.5] [7.5,8.5]
    assert _exposed(schedule, 4.0, 4) == pytest.approx((8.5, 2.5))
    # one bucket: final only when B1 ends, whatever the overlap
    assert _exposed(schedule, 4.0, 1) == pytest.approx((10.0, 4.0))


def check_four_rank_oracle() -> None:
    """1F1B, p = 4, m = 4: makespan (m + p - 1)(F + B) = 21; rank r's last B is
    [19 - 2r, 21 - 2r]. R = 3 in k = 3 buckets of 1 each, on every stage."""
    schedule = build_schedule("1f1b", 4, 4)
    # plain: final at e - 4/3, e - 2/3, e: the first ends e - 1/3, the last e + 5/3
    assert _exposed(schedule, 3.0, 3) == pytest.approx((21 + 5 / 3, *(5 / 3,) * 4))
    assert _exposed(schedule, 3.0, 3, "after_backward") == pytest.approx((24.0, *(3.0,) * 4))


def check_chunk_oracle() -> None:
    """One rank holding two stages (v = 2): 0F0 [0,1], 1F0 [1,2], 1B0 [2,4], 0B0 [4,6]."""
    schedule = Schedule.from_text("0F0 1F0 1B0 0B0")
    # after the backward, R = 3, k = 1: stage 1 at its REDUCE_GRAD (4) -> [4,7] (hidden
    # behind 0B0 for 2), then stage 0 at 6 waits for the lane -> [7,10]
    assert _exposed(schedule, 3.0, 1, "after_backward") == pytest.approx((10.0, 4.0))
    # after the flush: both from 6 -> 12
    assert _exposed(schedule, 3.0, 1, "after_flush") == pytest.approx((12.0, 6.0))
    # overlap, k = 2 (1.5 each): stage 1 final at 3, 4 -> [3,4.5] [4.5,6]; stage 0 at 5, 6
    # -> [6,7.5] [7.5,9]
    assert _exposed(schedule, 3.0, 2) == pytest.approx((9.0, 3.0))
    # a REDUCE_GRAD placed later in the stream launches there (after 0B0, at 6)
    late = Schedule.from_text("0F0 1F0 1B0 0B0 0REDUCE_GRAD 1REDUCE_GRAD STEP")
    assert _exposed(late, 3.0, 1, "after_backward") == pytest.approx((12.0, 6.0))


def check_split_backward_oracle() -> None:
    """A split last backward (W) launches at REDUCE_GRAD: the engine's hooks skip it.
    F0 [0,1], I0 [1,2], W0 [2,3]; R = 2, k = 2."""
    split = Schedule.from_text("0F0 0I0 0W0")
    assert _exposed(split, 2.0, 2) == pytest.approx((5.0, 2.0))
    fused = Schedule.from_text("0F0 0B0")  # B [1,3]: final at 2, 3 -> [2,3] [3,4]
    assert _exposed(fused, 2.0, 2) == pytest.approx((4.0, 1.0))


ORACLES = [check_one_rank_oracle, check_four_rank_oracle, check_chunk_oracle,
           check_split_backward_oracle]


@pytest.mark.parametrize("oracle", ORACLES)
def test_simulated_reduction_matches_the_hand_computed_one(oracle: Callable[[], None]) -> None:
    oracle()


# -- planted bugs: each breaks one part of the rule, and an oracle must notice ---------------

def _first_layers_first(start: float, end: float, buckets: int) -> np.ndarray:
    return start + np.arange(buckets, 0, -1) / buckets * (end - start)


def _final_at_the_end(start: float, end: float, buckets: int) -> np.ndarray:
    # every bucket waits for the whole backward (the one-range-per-rank ZeRO-1 layout's
    # worst case): nothing hides
    return np.full(buckets, end)


def _no_lane(rank: int, launches: Any, seconds: Any, buckets: Any, **kwargs: Any
             ) -> Lane:
    lane = reduction_module.reduce_rank(rank, launches, seconds, buckets, **kwargs)
    # every bucket as soon as it is launched: no single lane
    return lane._replace(start=lane.launch, end=lane.launch + lane.end - lane.start)


def _every_backward_hooked(*args: Any) -> list[StageLaunch]:
    return [launch._replace(hooked=True)
            for launch in reduction_module.stage_launches(*args)]


@pytest.mark.parametrize(("target", "mutant", "caught_by"), [
    (reduction_module, ("bucket_ready", _first_layers_first), check_one_rank_oracle),
    (reduction_module, ("bucket_ready", _final_at_the_end), check_four_rank_oracle),
    (simulate_module, ("reduce_rank", _no_lane), check_chunk_oracle),
    (simulate_module, ("stage_launches", _every_backward_hooked), check_split_backward_oracle),
], ids=["bucket-order-ignored", "final-only-at-the-end", "no-single-lane", "split-w-hooked"])
def test_planted_bug_is_caught(monkeypatch: pytest.MonkeyPatch, target: Any,
                               mutant: tuple[str, Any], caught_by: Callable[[], None]) -> None:
    caught_by()  # the oracle holds on the real rule ...
    monkeypatch.setattr(target, *mutant)
    with pytest.raises(AssertionError):
        caught_by()  # ... and fails on the planted bug


# -- properties ------------------------------------------------------------------------------

cases = st.fixed_dictionaries({
    "name": st.sampled_from(["1f1b", "gpipe", "interleaved", "zb-h1"]),
    "p": st.integers(1, 4), "m": st.integers(1, 6),
    "forward": st.floats(0.1, 3.0), "backward": st.floats(0.1, 3.0),
    "weight": st.floats(0.0, 3.0), "comm": st.floats(0.0, 1.0),
    "time": st.lists(st.floats(0.0, 20.0), min_size=8, max_size=8),
    "buckets": st.lists(st.integers(1, 6), min_size=8, max_size=8)})


def _simulate(case: dict[str, Any], start: str | None) -> Any:
    chunks = 2 if case["name"] == "interleaved" else 1
    p = case["p"] if chunks == 1 or case["m"] % case["p"] == 0 else 1
    schedule = build_schedule(case["name"], p, case["m"], chunks)
    stages = schedule.num_stages
    reduction = None if start is None else GradReduction(
        time=case["time"][:stages], buckets=case["buckets"][:stages],
        start=start)  # type: ignore[arg-type]
    costs = CostModel(forward=case["forward"], backward=case["backward"],
                      weight=case["weight"], comm=case["comm"], reduction=reduction)
    return schedule, simulate(schedule, costs)


def _compute_rows(timeline: Any) -> list[tuple[Any, ...]]:
    mask = timeline.compute_mask()
    return list(zip(*(getattr(timeline, n)[mask].tolist()
                      for n in ("rank", "kind", "stage", "microbatch", "start", "end"))))


@given(case=cases)
def test_reduction_properties(case: dict[str, Any]) -> None:
    schedule, plain = _simulate(case, None)
    results = {start: _simulate(case, start)[1]
               for start in ("overlap", "after_backward", "after_flush")}
    base = figures(plain)
    per_rank_time = np.zeros(schedule.num_ranks)
    for stage, rank in enumerate(schedule.placement):
        per_rank_time[rank] += case["time"][stage]
    steps = {}
    for start, timeline in results.items():
        result = figures(timeline)
        # the reduction never delays compute: the compute rows are today's
        assert _compute_rows(timeline) == _compute_rows(plain)
        assert result.makespan == base.makespan
        exposed = np.asarray(result.exposed_reduction)
        assert (exposed >= 0).all()
        assert (exposed <= per_rank_time + 1e-9).all()  # at worst the whole reduction
        assert result.step is not None and result.step >= base.makespan - 1e-12
        steps[start] = result.step
        _check_lane(timeline)
    # launching earlier never ends later
    assert steps["overlap"] <= steps["after_backward"] + 1e-9
    assert steps["after_backward"] <= steps["after_flush"] + 1e-9


def _check_lane(timeline: Any) -> None:
    """One bucket at a time per rank, in the order they run."""
    rows = timeline.kind == list(Kind).index(Kind.REDUCE_GRAD)
    for rank in range(timeline.num_ranks):
        mine = rows & (timeline.rank == rank)
        start, end = timeline.start[mine], timeline.end[mine]
        assert (end[:-1] <= start[1:] + 1e-9).all()
        if mine.any():  # the lane ends with its last bucket (one of no time is not drawn)
            assert end.max() <= timeline.reduction_ends[rank] + 1e-9


@given(case=cases, start=st.sampled_from(["overlap", "after_backward", "after_flush"]))
def test_zero_reduction_time_leaves_the_timeline_as_today(case: dict[str, Any],
                                                          start: str) -> None:
    case = {**case, "time": [0.0] * 8}
    _, plain = _simulate(case, None)
    _, timeline = _simulate(case, start)
    for name in ("rank", "kind", "stage", "microbatch", "start", "end"):
        assert np.array_equal(getattr(timeline, name), getattr(plain, name))
    result, base = figures(timeline), figures(plain)
    assert result.step == base.makespan and not any(result.exposed_reduction)
    assert base.to_dict().keys() == {"makespan", "bubble_rate", "idle_fraction", "ranks"}


def test_lane_runs_buckets_in_launch_order() -> None:
    spans = reduction_module.reduce_rank(
        0, [StageLaunch(1, 2.0, 4.0, True, 4.0, 5), StageLaunch(0, 4.0, 6.0, True, 6.0, 9)],
        [3.0, 3.0], [2, 2], start="overlap").spans()
    assert [(s.stage, s.bucket) for s in spans] == [(1, 0), (1, 1), (0, 0), (0, 1)]
    # flat: pytest >= 9.2 refuses nested structures in approx
    assert [t for s in spans for t in (s.start, s.end)] == pytest.approx(
        [3.0, 4.5, 4.5, 6.0, 6.0, 7.5, 7.5, 9.0])


def test_ring_time_is_the_textbook_one() -> None:
    # 2(d-1)/d · n / B for the all-reduce, half of it for ZeRO-1's reduce-scatter
    assert ring_reduction_time(8.0, 4, 2.0) == pytest.approx(2 * 3 / 4 * 8 / 2)
    assert ring_reduction_time(8.0, 4, 2.0, zero_stage=1) == pytest.approx(3 / 4 * 8 / 2)
    assert ring_reduction_time(8.0, 1, 2.0) == 0.0


@pytest.mark.parametrize(("fields", "match"), [
    ({"time": -1.0}, "reduction time"), ({"time": 1.0, "buckets": 0}, "buckets"),
    ({"time": 1.0, "start": "later"}, "start must be"),
    ({"time": 1.0, "buckets": [1, 0]}, "buckets"),
])
def test_bad_reduction_is_refused_where_it_is_written(fields: dict[str, Any],
                                                      match: str) -> None:
    with pytest.raises(ScheduleConfigError, match=match):
        GradReduction(**fields)


def test_wrong_number_of_stages_is_refused() -> None:
    costs = CostModel(reduction=GradReduction(time=[1.0, 2.0], buckets=2))
    with pytest.raises(ScheduleConfigError, match="2 values but the schedule has 4 stages"):
        simulate(build_schedule("1f1b", 4, 4), costs)
