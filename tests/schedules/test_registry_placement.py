"""Every registered schedule places its stages where the registry says (`ScheduleSpec.placement`),
and every cost-aware one defaults to the memory limit the registry states
(`ScheduleSpec.default_limit`): the planner reads both instead of building a schedule per
configuration."""

from __future__ import annotations

import importlib.util

import pytest

from schedules import SCHEDULES, figures, generate_schedule, simulate

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
        pytest.skip("zb-optimal needs ortools (pip install ortools)")
    m = 2 * p if name != "zb-optimal" else p
    schedule = generate_schedule(name, p, m, v)
    assert SCHEDULES[name].placement(p, v) == schedule.placement


@pytest.mark.parametrize("name", [n for n, spec in SCHEDULES.items() if spec.plan is not None])
def test_registry_default_limit_is_the_schedules_own(name: str) -> None:
    # regression: the planner named interleaved-zb's v·p default itself
    if name == "zb-optimal" and not _SOLVER:
        pytest.skip("zb-optimal needs ortools (pip install ortools)")
    spec = SCHEDULES[name]
    low, high = spec.chunks
    for p, v in ((2, low), (3, high if high is not None else low + 1)):
        m = 2 * p
        limit = spec.default_limit(p, v)
        assert generate_schedule(name, p, m, v).streams == \
            generate_schedule(name, p, m, v, memory_limit=limit).streams, (name, p, v)
        if limit > v:  # a tighter limit changes the order: the comparison can tell them apart
            tighter = generate_schedule(name, p, m, v, memory_limit=limit - 1)
            assert tighter.streams != generate_schedule(name, p, m, v).streams, (name, p, v)
            assert max(figures(simulate(tighter)).peak_activations) <= limit - 1, (name, p, v)
