"""zb-optimal: valid, within its limit, never above a heuristic; a clear error without OR-Tools."""

from __future__ import annotations

import builtins
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    SCHEDULES,
    CostModel,
    ScheduleConfigError,
    figures,
    generate_schedule,
    simulate,
    solve_zb_optimal,
    validate,
)

pytest.importorskip("ortools", reason="zb-optimal needs the 'solver' extra")

HEURISTICS = {1: ["1f1b", "zb-h1", "zb-h2", "zb-auto"], 2: ["zb-v", "zb-v-auto"]}


@settings(max_examples=8, deadline=None)
@given(p=st.integers(1, 3), m=st.integers(1, 5), v=st.sampled_from([1, 2]),
       weight=st.sampled_from([0.5, 1.0]), comm=st.sampled_from([0.0, 0.2]))
def test_the_optimum_is_valid_within_its_limit_and_never_above_a_heuristic(
        p: int, m: int, v: int, weight: float, comm: float) -> None:
    costs = CostModel(weight=weight, comm=comm)
    for name in HEURISTICS[v]:
        heuristic = generate_schedule(name, p, m, v if SCHEDULES[name].chunks[1] != 1 else None,
                                      costs=costs) if SCHEDULES[name].plan else \
            generate_schedule(name, p, m)
        found = figures(simulate(heuristic, costs))
        limit = max(found.peak_activations)
        plan = solve_zb_optimal(p, m, v, memory_limit=limit, costs=costs, time_limit=20)
        validate(plan.schedule)
        best = figures(simulate(plan.schedule, costs))
        assert max(best.peak_activations) <= limit
        assert best.makespan == pytest.approx(plan.makespan)
        assert plan.bound <= plan.makespan + 1e-9
        assert plan.makespan <= found.makespan + 1e-9, name


def test_the_optimum_closes_zb_v_tables_bubble_at_p4_m4() -> None:
    plan = solve_zb_optimal(4, 4, 2, memory_limit=8, time_limit=20)
    assert plan.proven and plan.gap == 0.0
    assert plan.makespan == 27.0  # 24 units of work; the table takes 30


def test_registered_and_lowers() -> None:
    schedule = generate_schedule("zb-optimal", 2, 3, memory_limit=3)
    validate(schedule)
    assert schedule.name == "zb-optimal"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_ranks": 9, "num_microbatches": 4}, "p <= 8 and m <= 16"),
    ({"num_ranks": 3, "num_microbatches": 17}, "p <= 8 and m <= 16"),
    ({"num_ranks": 3, "num_microbatches": 4, "chunks": 2, "memory_limit": 1},
     "the minimum is 2"),
    ({"num_ranks": 3, "num_microbatches": 4, "time_limit": 0}, "time_limit must be"),
    ({"num_ranks": 2, "num_microbatches": 2, "placement": (0, 2)}, "on every rank 0..1"),
])
def test_bad_input_gets_one_line_naming_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ScheduleConfigError, match=message) as caught:
        solve_zb_optimal(**kwargs)
    assert "\n" not in str(caught.value)


def test_without_ortools_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def refuse(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("ortools"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)
    with pytest.raises(ScheduleConfigError, match=r"pipesched\[solver\]") as caught:
        solve_zb_optimal(2, 2)
    assert "\n" not in str(caught.value)


def test_every_rank_building_zb_optimal_gets_the_same_order() -> None:
    # regression: with two solver workers and a wall-clock limit, ranks that each build
    # the schedule could get different orders when the limit hit (the engine then refuses)
    first, second = (solve_zb_optimal(4, 8, 2, time_limit=0.5) for _ in range(2))
    assert first.schedule.format() == second.schedule.format()
    assert (first.makespan, first.bound) == (second.makespan, second.bound)
