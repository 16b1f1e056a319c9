"""`ComputeRuns`: a simulation that reuses a kept compute run equals one made afresh."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import pytest

from schedules import (
    ComputeRuns,
    CostModel,
    GradReduction,
    ParamGather,
    generate_schedule,
    simulate,
)
from schedules.analysis.all_to_all import ExpertAllToAll
from schedules.analysis.timeline import Timeline

BASE = CostModel(forward=[1.0, 1.5, 1.0, 2.0], backward=[1.0, 2.0, 1.5, 1.0],
                 weight=[0.5, 1.0, 0.5, 0.5], comm=0.1, activation_bytes=[1.0, 2.0, 1.0, 0.0],
                 bandwidth=10.0)
REDUCTIONS = [None, GradReduction(time=[2.0, 1.0, 3.0, 1.0], buckets=2),
              GradReduction(time=0.5, start="after_flush")]
# each changes one input of the compute run: a kept run must not answer for it
COMPUTE_CHANGES = [{"forward": [1.0, 1.5, 1.0, 2.5]}, {"backward": [1.0, 2.0, 1.5, 1.5]},
                   {"weight": [0.5, 1.0, 0.5, 0.75]}, {"comm": 0.2},
                   {"activation_bytes": [1.0, 3.0, 1.0, 0.0]}, {"bandwidth": 5.0},
                   {"all_to_all": ExpertAllToAll(forward=0.3, backward=0.2)}]


def same(a: Timeline, b: Timeline) -> bool:
    """Every column and figure of two timelines equal, to the bit."""
    for item in fields(Timeline):
        x, y = getattr(a, item.name), getattr(b, item.name)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("name", ["1f1b", "zb-v", "dualpipev-overlap", "interleaved"])
def test_kept_runs_equal_fresh_ones(name: str) -> None:
    """Reductions and exposed gathers vary on one schedule with a shared cache: each result
    is the uncached simulation's, and the compute ran once per compute costs."""
    chunks = 1 if name == "1f1b" else 2
    schedule = generate_schedule(name, 2 if chunks == 2 else 4, 4, chunks)
    runs = ComputeRuns()
    gathers = [None, ParamGather(time=1.0)]
    for change in [{}, *COMPUTE_CHANGES]:
        costs = replace(BASE, **change)
        for reduction in REDUCTIONS:
            for gather in gathers:
                model = replace(costs, reduction=reduction, gather=gather)
                assert same(simulate(schedule, model, runs=runs), simulate(schedule, model))
    assert runs.hits == (1 + len(COMPUTE_CHANGES)) * (len(REDUCTIONS) * len(gathers) - 1)


def test_overlapped_gather_is_not_kept() -> None:
    """An overlapped gather delays the forwards: its run is made each time, and right."""
    schedule = generate_schedule("1f1b", 4, 4, 1)
    runs = ComputeRuns()
    for time in (1.0, 3.0):
        model = replace(BASE, gather=ParamGather(time=time, overlap=True))
        assert same(simulate(schedule, model, runs=runs), simulate(schedule, model))
    assert runs.hits == 0 and len(runs) == 0


def test_another_schedule_object_misses() -> None:
    """Equal costs on another schedule (another p) or another object never share a run."""
    runs = ComputeRuns()
    costs = CostModel(forward=1.0, backward=1.0, weight=1.0)
    first = generate_schedule("zb-h1", 4, 8, 1)
    simulate(first, costs, runs=runs)
    other = generate_schedule("zb-h2", 4, 8, 1)
    assert same(simulate(other, costs, runs=runs), simulate(other, costs))
    assert runs.hits == 0


def test_budget_drops_least_recently_used() -> None:
    """Past `max_ops` executed ops the oldest run goes; one larger than the budget is not
    kept."""
    schedule = generate_schedule("1f1b", 4, 4, 1)  # 4 ranks × 4 microbatches × (F, B)
    runs = ComputeRuns(max_ops=64)
    for forward in (1.0, 2.0, 3.0):
        simulate(schedule, replace(BASE, forward=forward), runs=runs)
    assert len(runs) == 2
    simulate(schedule, replace(BASE, forward=1.0), runs=runs)
    assert runs.hits == 0
    simulate(schedule, replace(BASE, forward=3.0), runs=runs)
    assert runs.hits == 1
    small = ComputeRuns(max_ops=10)
    simulate(schedule, BASE, runs=small)
    assert len(small) == 0
    with pytest.raises(ValueError, match="max_ops"):
        ComputeRuns(max_ops=-1)
