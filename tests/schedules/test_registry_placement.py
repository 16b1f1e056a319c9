"""Every registered schedule places its stages where the registry says (`ScheduleSpec.placement`),
which the planner reads instead of building a schedule per configuration."""

from __future__ import annotations

import importlib.util

import pytest

from schedules import SCHEDULES, generate_schedule

__all__: list[str] = []

_SOLVER = importlib.util.find_spec("ortools") is not None


def _cases() -> list[tuple[str, int, int]]:
    cases = []
    for name, spec in SCHEDULES.items():
        low, high = spec.chunks
        for v in sorted({low, high if high is not None else low + 1}):
            for p in (2, 4):
                cases.append((name, p, v))
    return cases


@pytest.mark.parametrize(("name", "p", "v"), _cases())
def test_registry_placement_is_the_schedules_own(name: str, p: int, v: int) -> None:
    # regression: the planner kept its own list of V-shaped schedules, which went stale
    if name == "zb-optimal" and not _SOLVER:
        pytest.skip("zb-optimal needs ortools (pip install 'pipesched[solver]')")
    m = 2 * p if name != "zb-optimal" else p
    schedule = generate_schedule(name, p, m, v)
    assert SCHEDULES[name].placement(p, v) == schedule.placement
