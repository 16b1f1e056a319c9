"""zb-auto: never worse than ZB-H1 under equal memory, keeps its limit, zero bubble if it can."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedules import (
    CostModel,
    ScheduleConfigError,
    build_schedule,
    figures,
    generate_schedule,
    search_zb_auto,
    simulate,
    validate,
    zb_auto,
    zb_h1,
)
from tests.support.zb_helpers import iteration_cost

times = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0])


@st.composite
def cost_models(draw: st.DrawFn) -> CostModel:
    return CostModel(forward=draw(times), backward=draw(times), weight=draw(times),
                     comm=draw(st.sampled_from([0.0, 0.05, 0.5])))


@given(p=st.integers(1, 6), m=st.integers(1, 18), slack=st.integers(0, 8), costs=cost_models())
def test_never_worse_than_zb_h1_under_the_same_memory(p: int, m: int, slack: int,
                                                     costs: CostModel) -> None:
    limit = p + slack  # ZB-H1 holds at most p
    schedule = zb_auto(p, m, memory_limit=limit, costs=costs)
    validate(schedule)
    ours, theirs = simulate(schedule, costs), simulate(zb_h1(p, m), costs)
    assert iteration_cost(ours) <= iteration_cost(theirs) + 1e-9
    assert max(figures(ours).peak_activations) <= limit


@given(p=st.integers(1, 6), m=st.integers(1, 18), limit=st.integers(1, 6), costs=cost_models())
def test_keeps_any_memory_limit_even_below_1f1b(p: int, m: int, limit: int,
                                                costs: CostModel) -> None:
    schedule = zb_auto(p, m, memory_limit=limit, costs=costs)
    validate(build_schedule("zb-auto", p, m, memory_limit=limit, costs=costs))
    assert max(figures(simulate(schedule, costs)).peak_activations) <= limit


@given(p=st.integers(1, 6), extra=st.integers(0, 12))
def test_reaches_zero_bubble_at_unit_costs_with_2p_memory(p: int, extra: int) -> None:
    m = 2 * p - 1 + extra
    result = figures(simulate(zb_auto(p, m)))  # defaults: memory 2p, unit costs
    assert result.bubble_rate == 0.0


def test_beats_the_handcrafted_schedules_on_realistic_costs() -> None:
    # F ≈ B ≈ 2W with a small comm delay: the greedy search wins over ZB-H1 and ZB-H2.
    costs = CostModel(forward=1.0, backward=1.0, weight=0.5, comm=0.05)
    plan = search_zb_auto(8, 24, memory_limit=16, costs=costs)
    by_label = {candidate.label: candidate for candidate in plan.candidates}
    best = plan.candidates[0]
    assert best.label.startswith("greedy")
    assert best.cost < by_label["zb-h2"].cost < by_label["zb-h1"].cost
    assert [c.cost for c in plan.candidates] == sorted(c.cost for c in plan.candidates)
    assert iteration_cost(simulate(plan.schedule, costs)) == pytest.approx(best.cost)


def test_handcrafted_candidates_only_within_the_limit() -> None:
    labels = {c.label for c in search_zb_auto(4, 12, memory_limit=4).candidates}
    assert "zb-h1" in labels and "zb-h2" not in labels
    labels = {c.label for c in search_zb_auto(4, 12, memory_limit=3).candidates}
    assert not labels & {"zb-h1", "zb-h2"}


def test_per_stage_costs_are_used() -> None:
    slow_last = CostModel(forward=[1, 1, 1, 3], backward=[1, 1, 1, 3], weight=1.0)
    schedule = generate_schedule("zb-auto", 4, 8, costs=slow_last, memory_limit=8)
    assert iteration_cost(simulate(schedule, slow_last)) <= \
        iteration_cost(simulate(zb_h1(4, 8), slow_last))


@pytest.mark.parametrize("limit", [0, -1, True])
def test_memory_limit_must_be_a_positive_int(limit: int) -> None:
    with pytest.raises(ScheduleConfigError, match="memory_limit must"):
        zb_auto(4, 8, memory_limit=limit)


def test_costs_must_match_the_stage_count() -> None:
    with pytest.raises(ScheduleConfigError, match="forward has 2 values but the schedule has 4"):
        zb_auto(4, 8, costs=CostModel(forward=[1.0, 2.0]))
