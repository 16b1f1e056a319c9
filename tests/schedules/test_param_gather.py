"""The simulated ZeRO-1 parameter all-gather: oracles by hand, properties, planted bugs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import schedules.analysis.simulate as simulate_module
from schedules import (
    CostModel,
    GradReduction,
    ParamGather,
    Schedule,
    ScheduleConfigError,
    build_schedule,
    figures,
    simulate,
)
from schedules.analysis.gather import forward_release
from schedules.analysis.reduction import StageLaunch, reduce_rank

__all__: list[str] = []


def _run(schedule: Schedule, time: float, buckets: int, overlap: bool, *,
         layers: int | None = None, reduction: GradReduction | None = None
         ) -> tuple[float, ...]:
    """The step and each rank's exposed gather; F = 1, a fused B = 2."""
    costs = CostModel(forward=1.0, backward=1.0, weight=1.0, reduction=reduction,
                      gather=ParamGather(time=time, buckets=buckets, overlap=overlap,
                                         layers=layers))
    result = figures(simulate(schedule, costs))
    assert result.step is not None
    return (result.step, *result.exposed_gather)


# -- oracles, worked out by hand from the rule (`schedules.analysis.gather`) -------------------

def check_one_rank_oracle() -> None:
    """1F1B, p = 1, m = 2: F0 [0,1], B0 [1,3], F1 [3,4], B1 [4,6] without a gather.
    G = 4 in k = 4 buckets of 1: they arrive at 1, 2, 3, 4."""
    schedule = build_schedule("1f1b", 1, 2)
    # blocking: after the compute, [6, 10]
    assert _run(schedule, 4.0, 4, False) == pytest.approx((10.0, 4.0))
    # overlapped, one quarter of F per bucket: quarters wait for 1, 2, 3, 4 -> F0 ends at
    # 4.25, as a whole F from max(1 - 0, 2 - 1/4, 3 - 2/4, 4 - 3/4) = 3.25: all shifts 3.25
    assert _run(schedule, 4.0, 4, True) == pytest.approx((9.25, 3.25))
    # one layer holding every bucket waits for the last: as exposed as blocking here
    assert _run(schedule, 4.0, 4, True, layers=1) == pytest.approx((10.0, 4.0))
    # two layers of two buckets each: max(2 - 0, 4 - 1/2) = 3.5
    assert _run(schedule, 4.0, 4, True, layers=2) == pytest.approx((9.5, 3.5))


def check_blocking_after_reduction_oracle() -> None:
    """Blocking, the gather waits for the reduction on the lane: R = 4 in 4 overlapped
    buckets ends at 8.5 (`test_grad_reduction`'s one-rank oracle), then the gather [8.5, 12.5]."""
    schedule = build_schedule("1f1b", 1, 2)
    reduction = GradReduction(time=4.0, buckets=4)
    costs = CostModel(forward=1.0, backward=1.0, weight=1.0, reduction=reduction,
                      gather=ParamGather(time=4.0, buckets=4))
    result = figures(simulate(schedule, costs))
    assert (result.step, *result.exposed_gather) == pytest.approx((12.5, 4.0))
    assert result.exposed_reduction == pytest.approx((2.5,))


def check_two_rank_oracle() -> None:
    """1F1B, p = 2, m = 2: makespan (m + p - 1)(F + B) = 9; rank 0's last B ends at 9,
    rank 1's at 7. G = 2 in k = 2 buckets per stage, arriving at 1 and 2 on each rank."""
    schedule = build_schedule("1f1b", 2, 2)
    # blocking: rank 0 [9, 11], rank 1 [7, 9]
    assert _run(schedule, 2.0, 2, False) == pytest.approx((11.0, 2.0, 2.0))
    # overlapped: rank 0's F0 from max(1, 2 - 1/2) = 1.5; rank 1's first F needs rank 0's
    # output (2.5), past its own 1.5: it waits for nothing, the pipeline shifts by 1.5
    assert _run(schedule, 2.0, 2, True) == pytest.approx((10.5, 1.5, 0.0))


def check_chunk_oracle() -> None:
    """One rank holding two stages: 0F0 1F0 1B0 0B0. G = 2 per stage, one bucket each:
    stage 0's first (the engine's region order), [0,2], then stage 1's, [2,4]."""
    schedule = Schedule.from_text("0F0 1F0 1B0 0B0")
    # 0F0 waits to 2 [2,3]; 1F0 to 4 [4,5]; 1B0 [5,7]; 0B0 [7,9]: waits 2 + 1
    assert _run(schedule, 2.0, 1, True) == pytest.approx((9.0, 3.0))
    # blocking: after the compute (6), both stages' gathers: [6, 10]
    assert _run(schedule, 2.0, 1, False) == pytest.approx((10.0, 4.0))


ORACLES = [check_one_rank_oracle, check_blocking_after_reduction_oracle, check_two_rank_oracle,
           check_chunk_oracle]


@pytest.mark.parametrize("oracle", ORACLES)
def test_simulated_gather_matches_the_hand_computed_one(oracle: Callable[[], None]) -> None:
    oracle()


# -- planted bugs: each breaks one part of the rule, and an oracle must notice ---------------

def _waits_for_the_whole_stage(real: Any) -> Any:
    def whole_stage(arrivals: np.ndarray, forward: float, layers: int | None) -> float:
        return float(arrivals[-1]) if len(arrivals) else 0.0
    return whole_stage


def _stages_last_first(real: Any) -> Any:
    def last_first(stages: Any, seconds: Any, buckets: Any, start: float) -> Any:
        stage_of, index, begin, end = real(stages, seconds, buckets, start)
        order = np.argsort(-stage_of, kind="stable")  # the rank's highest stage first
        finish = start + np.cumsum((end - begin)[order])
        return stage_of[order], index[order], finish - (end - begin)[order], finish
    return last_first


def _waits_not_counted(real: Any) -> Any:
    def uncounted(*args: Any) -> Any:
        run = real(*args)
        return run._replace(waited=None if run.waited is None else [0.0] * len(run.waited))
    return uncounted


def _gather_beside_the_reduction(real: Any) -> Any:
    def beside(timeline: Any, schedule: Any, run: Any, gathers: Any, overlap: bool,
               lanes: Any) -> Any:
        return real(timeline, schedule, run, gathers, overlap, None)  # from the compute's end
    return beside


@pytest.mark.parametrize(("name", "mutant", "caught_by"), [
    ("forward_release", _waits_for_the_whole_stage, check_one_rank_oracle),
    ("gather_lane", _stages_last_first, check_chunk_oracle),
    ("execute", _waits_not_counted, check_two_rank_oracle),
    ("_with_gather", _gather_beside_the_reduction, check_blocking_after_reduction_oracle),
], ids=["whole-stage-wait", "stages-last-first", "waits-not-counted",
        "gather-beside-the-reduction"])
def test_planted_bug_is_caught(monkeypatch: pytest.MonkeyPatch, name: str, mutant: Any,
                               caught_by: Callable[[], None]) -> None:
    caught_by()  # the oracle holds on the real rule ...
    monkeypatch.setattr(simulate_module, name, mutant(getattr(simulate_module, name)))
    with pytest.raises(AssertionError):
        caught_by()  # ... and fails on the planted bug


# -- properties ------------------------------------------------------------------------------

cases = st.fixed_dictionaries({
    "name": st.sampled_from(["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v"]),
    "p": st.integers(1, 4), "m": st.integers(1, 6),
    "forward": st.floats(0.1, 3.0), "backward": st.floats(0.1, 3.0),
    "weight": st.floats(0.0, 3.0), "comm": st.floats(0.0, 1.0),
    "reduce": st.one_of(st.none(), st.floats(0.0, 10.0)),
    "time": st.floats(0.0, 20.0), "buckets": st.integers(1, 6),
    "layers": st.one_of(st.none(), st.integers(1, 8))})


def _simulate(case: dict[str, Any], overlap: bool | None) -> Any:
    chunks = 2 if case["name"] in ("interleaved", "zb-v") else 1
    p = case["p"] if case["name"] != "interleaved" or case["m"] % case["p"] == 0 else 1
    schedule = build_schedule(case["name"], p, case["m"], chunks)
    reduction = None if case["reduce"] is None else GradReduction(time=case["reduce"],
                                                                  buckets=case["buckets"])
    gather = None if overlap is None else ParamGather(
        time=case["time"], buckets=case["buckets"], overlap=overlap, layers=case["layers"])
    costs = CostModel(forward=case["forward"], backward=case["backward"],
                      weight=case["weight"], comm=case["comm"], reduction=reduction,
                      gather=gather)
    return schedule, simulate(schedule, costs)


def _compute(timeline: Any, *names: str) -> list[tuple[Any, ...]]:
    mask = timeline.compute_mask()
    return list(zip(*(getattr(timeline, n)[mask].tolist() for n in names)))


def _step(timeline: Any) -> float:
    result = figures(timeline)
    return result.makespan if result.step is None else result.step


@given(case=cases)
def test_gather_properties(case: dict[str, Any]) -> None:
    schedule, plain = _simulate(case, None)
    _, blocking = _simulate(case, False)
    _, overlapped = _simulate(case, True)
    per_rank = np.bincount(schedule.placement, minlength=schedule.num_ranks) * case["time"]
    order = ("rank", "kind", "stage", "microbatch")
    # blocking leaves the compute as it is and exposes every rank's whole gather
    assert _compute(blocking, *order, "start", "end") == _compute(plain, *order, "start", "end")
    assert figures(blocking).exposed_gather == pytest.approx(tuple(per_rank.tolist()))
    # overlapped keeps the compute order, only later, and never past the whole gather
    assert _compute(overlapped, *order) == _compute(plain, *order)
    late = np.array(_compute(overlapped, "start")) - np.array(_compute(plain, "start"))
    assert (late >= -1e-9).all() and (late <= per_rank.max() + 1e-9).all()
    exposed = np.asarray(figures(overlapped).exposed_gather)
    assert (exposed >= 0).all() and (exposed <= per_rank + 1e-9).all()
    # every rank gathering the same: overlapped is never slower than blocking
    assert _step(plain) - 1e-9 <= _step(overlapped) <= _step(blocking) + 1e-9
    assert _step(blocking) == pytest.approx(max(
        end + g for end, g in zip(_rank_ends(plain), per_rank.tolist())))


def _rank_ends(timeline: Any) -> list[float]:
    ends = [0.0] * timeline.num_ranks
    for rank, end in _compute(timeline, "rank", "end"):
        ends[rank] = max(ends[rank], end)
    for rank, end in enumerate(timeline.reduction_ends):
        ends[rank] = max(ends[rank], end)
    return ends


@given(case=cases, overlap=st.booleans())
def test_zero_gather_time_leaves_the_timeline_as_today(case: dict[str, Any],
                                                       overlap: bool) -> None:
    case = {**case, "time": 0.0}
    _, plain = _simulate(case, None)
    _, timeline = _simulate(case, overlap)
    for name in ("rank", "kind", "stage", "microbatch", "start", "end"):
        assert np.array_equal(getattr(timeline, name), getattr(plain, name))
    assert _step(timeline) == _step(plain)
    assert not any(figures(timeline).exposed_gather)


def test_no_gather_leaves_the_figures_as_today() -> None:
    result = figures(simulate(build_schedule("1f1b", 2, 4), CostModel(
        reduction=GradReduction(time=1.0))))
    assert result.exposed_gather == ()
    assert "exposed_gather" not in result.to_dict()["ranks"][0]


def test_reductions_queue_behind_gathers_still_on_the_lane() -> None:
    launch = StageLaunch(0, 2.0, 4.0, False, 4.0, 3)
    lane = reduce_rank(0, [launch], [2.0], [2], start="after_backward", free_at=5.0)
    # flat: pytest >= 9.2 refuses nested structures in approx
    assert [t for s in lane.spans() for t in (s.start, s.end)] == pytest.approx(
        [5.0, 6.0, 6.0, 7.0])


def test_release_is_the_layerwise_wait() -> None:
    # 3 buckets at 1, 2, 6; F = 3 in 3 layers: max(1, 2 - 1, 6 - 2) = 4
    assert forward_release(np.array([1.0, 2.0, 6.0]), 3.0, 3) == pytest.approx(4.0)
    # 2 layers over 3 buckets: layer 0 needs buckets 0, 1 (2), layer 1 bucket 2: 6 - 1.5
    assert forward_release(np.array([1.0, 2.0, 6.0]), 3.0, 2) == pytest.approx(4.5)


@pytest.mark.parametrize(("fields", "match"), [
    ({"time": -1.0}, "gather time"), ({"time": 1.0, "buckets": 0}, "buckets"),
    ({"time": 1.0, "layers": 0}, "layers"), ({"time": 1.0, "overlap": "yes"}, "overlap"),
])
def test_bad_gather_is_refused_where_it_is_written(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ScheduleConfigError, match=match):
        ParamGather(**fields)


def test_wrong_number_of_stages_is_refused() -> None:
    costs = CostModel(gather=ParamGather(time=[1.0, 2.0]))
    with pytest.raises(ScheduleConfigError, match="2 values but the schedule has 4 stages"):
        simulate(build_schedule("1f1b", 4, 4), costs)
