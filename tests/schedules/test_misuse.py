"""Costs whose sum overflows and a missing timeline are typed errors, not an `inf`
makespan or a bare AttributeError."""

from __future__ import annotations

import math

import pytest

from schedules import CostModel, ScheduleConfigError, build_schedule, figures, simulate


def test_costs_that_overflow_the_makespan_are_refused() -> None:
    # regression: CostModel(forward=1e308) gave a makespan of inf and NaN figures
    schedule = build_schedule("1f1b", 4, 8)
    with pytest.raises(ScheduleConfigError, match="sum past the largest float"):
        simulate(schedule, CostModel(forward=1e308))
    big = figures(simulate(schedule, CostModel(forward=1e300)))  # large but summable
    assert math.isfinite(big.makespan) and big.makespan >= 8 * 1e300


@pytest.mark.parametrize("value", [None, "timeline", 3])
def test_figures_of_something_else_is_a_type_error(value: object) -> None:
    # regression: figures(None) raised "AttributeError: 'NoneType' object has no attribute"
    with pytest.raises(TypeError, match=r"figures needs a schedules\.Timeline"):
        figures(value)  # type: ignore[arg-type]
