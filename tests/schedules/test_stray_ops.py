"""A compute-only schedule holds F, B, I, W and OVERLAP_B only: any other op is refused by name.

Regression for issue 34, item 3: `dataflow.execute` read STEP (stage -1, microbatch -1),
SEND/RECV and REDUCE_GRAD as backwards, so a stray STEP could stand in for a missing I and
a stray RECV could deadlock a valid order. The oracle below is the definition: a
compute-only schedule is accepted iff every op is a compute op and the compute order is
valid (checked on the schedule without the stray op by the validator, which the mutation
tests check against their own oracle).
"""

from __future__ import annotations

import random

import pytest

from schedules import (
    NONE,
    CostModel,
    Instruction,
    Kind,
    Schedule,
    ScheduleValidationError,
    build_schedule,
    figures,
    generate_schedule,
    simulate,
    validate,
)
from schedules.analysis.dataflow import execute

__all__: list[str] = []

COMPUTE = {Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP_B}


def _accepted(schedule: Schedule) -> bool:
    try:
        validate(schedule)
    except ScheduleValidationError:
        return False
    return True


def test_a_stray_step_does_not_stand_in_for_a_missing_input_gradient() -> None:
    # the reproducer: W(0, 1) before I(0, 1), with a STEP between
    schedule = Schedule.from_text("0F0 0F1 0I0 0W0 STEP 0W1 0I1", name="stray")
    schedule = Schedule(schedule.name, 2, (0,), schedule.streams, lowered=False)
    with pytest.raises(ScheduleValidationError, match="STEP"):
        validate(schedule)


def test_execute_reads_a_non_compute_op_as_no_work() -> None:
    # STEP used to run as a backward of "stage -1", writing another op's gradient end
    streams = [[Instruction(Kind.F, 0, 0), Instruction(Kind.STEP), Instruction(Kind.W, 0, 0),
                Instruction(Kind.I, 0, 0)]]
    run = execute(streams, [0], 1, [1.0], [1.0], [1.0], [0.0])
    assert run.stuck == {0: 2}  # W waits on its I, which comes after it


def _stray_ops(schedule: Schedule, rng: random.Random) -> list[Instruction]:
    s = rng.randrange(schedule.num_stages)
    i = rng.randrange(schedule.num_microbatches)
    rank = schedule.placement[s]
    peer = schedule.placement[min(s + 1, schedule.num_stages - 1)]
    return [Instruction(Kind.STEP), Instruction(Kind.REDUCE_GRAD, s, NONE),
            Instruction(Kind.LOAD, s, i), Instruction(Kind.SEND_F, s, i, peer),
            Instruction(Kind.RECV_B, s, i, peer), Instruction(Kind.SEND_B, s, i, rank),
            Instruction(Kind.RECV_F, s, i, rank)]


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "interleaved", "dualpipev-overlap",
                                  "forward-only"])
def test_stray_op_mutants_are_refused_by_name_and_cost_nothing(name: str) -> None:
    rng = random.Random(name)
    base = generate_schedule(name, 3, 6)
    costs = CostModel(forward=1.0, backward=2.0, weight=1.5, comm=0.5)
    expected = figures(simulate(base, costs))
    for trial in range(60):
        streams = [list(stream) for stream in base.streams]
        # Half the mutants also break the compute order (two adjacent compute ops swapped):
        # the oracle refuses them either way, and the validator must name the stray op.
        if trial % 2:
            rank = rng.randrange(len(streams))
            k = rng.randrange(len(streams[rank]) - 1)
            streams[rank][k], streams[rank][k + 1] = streams[rank][k + 1], streams[rank][k]
        compute_only = Schedule(name, base.num_microbatches, base.placement,
                                tuple(map(tuple, streams)))
        compute_valid = _accepted(compute_only)
        stray = rng.choice(_stray_ops(base, rng))
        rank = rng.randrange(len(streams))
        streams[rank].insert(rng.randrange(len(streams[rank]) + 1), stray)
        mutant = Schedule(name, base.num_microbatches, base.placement,
                          tuple(map(tuple, streams)), lowered=False)
        # the oracle: a non-compute op has no place in a compute-only schedule
        assert any(op.kind not in COMPUTE for stream in mutant.streams for op in stream)
        with pytest.raises(ScheduleValidationError, match=stray.kind.value) as refused:
            validate(mutant)
        assert "compute-only" in str(refused.value)
        if compute_valid and trial % 2 == 0:
            # the simulator gives the stray op no duration: the same figures as without it
            found = figures(simulate(mutant, costs))
            assert found.makespan == expected.makespan
            assert found.busy == expected.busy


def test_a_lowered_schedule_keeps_its_communication() -> None:
    # the refusal is for compute-only schedules: a lowered one is accepted as before
    validate(build_schedule("1f1b", 3, 6))
