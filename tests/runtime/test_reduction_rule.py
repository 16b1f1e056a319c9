"""The simulator's gradient-reduction launches agree with what the interpreter does."""

from __future__ import annotations

import pytest

from pipeline.runtime.interpreter import last_backwards
from schedules import SCHEDULES, Kind, build_schedule
from schedules.analysis.reduction import stage_launches

__all__: list[str] = []

FIXED = sorted(name for name, spec in SCHEDULES.items()
               if spec.plan is None and name != "forward-only")


@pytest.mark.parametrize("name", FIXED)
def test_simulator_overlaps_exactly_the_backwards_the_engine_arms(name: str) -> None:
    schedule = build_schedule(name, 4, 8, SCHEDULES[name].default_chunks)
    for rank, stream in enumerate(schedule.streams):
        compute = [k for k, op in enumerate(stream) if op.is_compute]
        row_of = {k: row for row, k in enumerate(compute)}
        # op times are their compute index: a launch names the op it comes from
        rows = [float(row) for row in range(len(compute))]
        launches = stage_launches(stream, rows, rows, schedule.stages_of(rank))
        armed = last_backwards(stream)  # step index -> stage, the engine's hooks
        assert {(launch.stage, int(launch.backward_start)) for launch in launches
                if launch.hooked} == {(stage, row_of[k]) for k, stage in armed.items()}
        # REDUCE_GRADs run in stream order, each after the compute op before it
        reduces = [k for k, op in enumerate(stream) if op.kind is Kind.REDUCE_GRAD]
        assert [launch.order for launch in launches] == reduces
        for launch, k in zip(launches, reduces):
            assert launch.reduce_grad == max(row for j, row in row_of.items() if j < k)
