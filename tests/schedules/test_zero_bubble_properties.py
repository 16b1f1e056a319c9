"""Hypothesis properties of ZB-H1, ZB-H2, ZB-V, DualPipeV, looped BFS: validity, bubble, memory."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from schedules import (
    CostModel,
    Kind,
    ScheduleConfigError,
    build_schedule,
    dualpipev,
    figures,
    generate_schedule,
    looped_bfs,
    one_f_one_b,
    simulate,
    validate,
    zb_h1,
    zb_h2,
    zb_v,
)
from tests.support.zb_helpers import iteration_cost

ranks = st.integers(1, 8)
UNIT = CostModel(forward=1.0, backward=1.0, weight=1.0)
NEW = ["zb-h1", "zb-h2", "zb-v", "dualpipev", "looped-bfs", "zb-auto"]


@st.composite
def zb_costs(draw: st.DrawFn) -> tuple[int, int, int]:
    """Integer F, B, W with W <= min(F, B): the regime of the paper's formulas."""
    forward, backward = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return forward, backward, draw(st.integers(1, min(forward, backward)))


@given(name=st.sampled_from(NEW), p=st.integers(1, 6), extra=st.integers(0, 12),
       v=st.integers(1, 3))
def test_every_new_schedule_validates_before_and_after_lowering(name: str, p: int, extra: int,
                                                                 v: int) -> None:
    m = extra + (2 * p if name == "dualpipev" else 1)
    chunks = v if name == "looped-bfs" else None
    compute = generate_schedule(name, p, m, chunks)
    validate(compute)
    validate(build_schedule(name, p, m, chunks))
    ops = [(op.kind, op.stage, op.microbatch) for stream in compute.streams for op in stream]
    assert len(ops) == len(set(ops))
    forwards = [op for op in ops if op[0] is Kind.F]
    assert len(forwards) == compute.num_stages * m


@given(p=ranks, extra=st.integers(0, 24), costs=zb_costs())
def test_zb_h1_cost_is_the_paper_formula(p: int, extra: int, costs: tuple[int, int, int]) -> None:
    # Qi et al. 2024 §3.1: ZB-H1's bubble is (p-1)(F+B-W), for m >= p.
    f, b, w = costs
    m = p + extra
    timeline = simulate(zb_h1(p, m), CostModel(forward=f, backward=b, weight=w))
    assert iteration_cost(timeline) == m * (f + b + w) + (p - 1) * (f + b - w)


@given(p=ranks, extra=st.integers(0, 24), costs=zb_costs())
def test_zb_h2_cost_is_the_paper_formula(p: int, extra: int, costs: tuple[int, int, int]) -> None:
    # §3.1: ZB-H2's bubble is (p-1)(F+B-2W), zero when F = B = W, for m >= 2p-1.
    f, b, w = costs
    m = 2 * p - 1 + extra
    timeline = simulate(zb_h2(p, m), CostModel(forward=f, backward=b, weight=w))
    assert iteration_cost(timeline) == m * (f + b + w) + (p - 1) * (f + b - 2 * w)


@given(p=ranks, extra=st.integers(0, 24))
def test_zb_h2_and_zb_v_have_no_bubble_at_unit_costs(p: int, extra: int) -> None:
    # Every rank is busy from its first op to its last; rank r starts r slots late (it
    # waits for microbatch 0), so the makespan is one busy rank plus p-1 slots.
    m = 2 * p - 1 + extra
    for schedule, busy in ((zb_h2(p, m), 3 * m), (zb_v(p, m), 6 * m)):
        result = figures(simulate(schedule, UNIT))
        assert result.bubble_rate == 0.0, schedule.name
        assert result.busy == (busy,) * p
        assert result.makespan == busy + p - 1


@given(p=ranks, m=st.integers(1, 40))
def test_zb_h1_holds_what_1f1b_holds_on_rank_0_and_at_most_p_anywhere(p: int, m: int) -> None:
    peaks = figures(simulate(zb_h1(p, m), UNIT)).peak_activations
    assert peaks[0] == figures(simulate(one_f_one_b(p, m), UNIT)).peak_activations[0]
    assert max(peaks) <= min(p, m)


@given(p=ranks, m=st.integers(1, 40))
def test_zb_h2_holds_at_most_2p_minus_1(p: int, m: int) -> None:
    peaks = figures(simulate(zb_h2(p, m), UNIT)).peak_activations
    assert max(peaks) <= min(2 * p - 1, m)
    if m >= 2 * p - 1:
        assert peaks[0] == 2 * p - 1


@given(p=ranks, m=st.integers(1, 40))
def test_zb_v_holds_p_stage_activations_on_every_rank(p: int, m: int) -> None:
    # A V chunk is half a rank's share: 2p chunk activations = p stage activations, which is
    # what 1F1B holds on rank 0.
    peaks = figures(simulate(zb_v(p, m), UNIT)).peak_activations
    assert max(peaks) <= 2 * p
    if m >= 2 * p - 1:
        assert set(peaks) == {2 * p}


@given(p=st.integers(1, 6), extra=st.integers(0, 16))
def test_dualpipev_bubble_and_memory_are_deepseeks(p: int, extra: int) -> None:
    # DeepSeek-V3 report, Table 2, with PP = 2p stages and no F/B overlap (F&B = F + B + W):
    # bubble (PP/2 - 1)(F&B + B - 3W) = p - 1 at unit chunk costs; activations PP + 1.
    m = 2 * p + extra
    timeline = simulate(dualpipev(p, m), UNIT)
    assert iteration_cost(timeline) == 6 * m + (p - 1)
    assert max(figures(timeline).peak_activations) == 2 * p + 1


@given(p=ranks, m=st.integers(1, 16), v=st.integers(1, 3))
def test_looped_bfs_runs_a_chunk_for_every_microbatch_before_the_next(p: int, m: int,
                                                                      v: int) -> None:
    schedule = looped_bfs(p, m, v)
    for rank, stream in enumerate(schedule.streams):
        stages = [op.stage for op in stream]
        assert stages == [c * p + rank for c in range(v) for _ in range(m)] + \
            [c * p + rank for c in reversed(range(v)) for _ in range(m)]
    assert figures(simulate(schedule, UNIT)).peak_activations == (v * m,) * p


@given(p=ranks, m=st.integers(1, 2 * 8 - 2))
def test_dualpipev_refuses_fewer_than_2p_microbatches(p: int, m: int) -> None:
    assume(m < 2 * p)
    with pytest.raises(ScheduleConfigError, match=rf"num_microbatches >= 2 × num_ranks = {2 * p}"):
        dualpipev(p, m)
    with pytest.raises(ScheduleConfigError, match="zb-v"):
        build_schedule("dualpipev", p, m)


@pytest.mark.parametrize(("name", "chunks", "message"), [
    ("zb-v", 3, "takes chunks in 2, got 3"),
    ("dualpipev", 1, "takes chunks in 2, got 1"),
    ("zb-h1", 2, "takes chunks in 1, got 2"),
    ("zb-auto", 2, "takes chunks in 1, got 2"),
])
def test_chunk_constraints_are_checked_up_front(name: str, chunks: int, message: str) -> None:
    with pytest.raises(ScheduleConfigError, match=message):
        generate_schedule(name, 4, 8, chunks)


@pytest.mark.parametrize("maker", [zb_h1, zb_h2, zb_v, dualpipev])
@pytest.mark.parametrize(("p", "m"), [(0, 8), (4, 0), (True, 8), (4, 2.0)])
def test_counts_must_be_positive_ints(maker: object, p: object, m: object) -> None:
    with pytest.raises(ScheduleConfigError, match="must be"):
        maker(p, m)  # type: ignore[operator]


def test_a_memory_limit_is_refused_by_fixed_schedules() -> None:
    with pytest.raises(ScheduleConfigError, match=r"takes no memory limit \(got 3\).*zb-auto"):
        generate_schedule("zb-h1", 4, 8, memory_limit=3)
