"""The fuse_backward pass: I+W back into one B, adjacent or everywhere, compute-only or lowered."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedules import (
    Kind,
    Schedule,
    ScheduleConfigError,
    add_optimizer_step,
    build_schedule,
    figures,
    fuse_backward,
    generate_schedule,
    lower,
    one_f_one_b,
    simulate,
    validate,
)

SPLIT = ["zb-h1", "zb-h2", "zb-v", "dualpipev", "zb-auto"]


def _kinds(schedule: Schedule) -> list[Kind]:
    return [op.kind for stream in schedule.streams for op in stream]


def test_adjacent_pairs_only() -> None:
    schedule = Schedule.from_text("0F0 0F1 0I0 0W0 0I1 0F2 0W1 0I2 0W2", num_microbatches=3)
    fused = fuse_backward(schedule)
    assert fused.format() == "rank 0: 0F0 0F1 0B0 0I1 0F2 0W1 0B2"
    everywhere = fuse_backward(schedule, where="all")
    assert everywhere.format() == "rank 0: 0F0 0F1 0B0 0B1 0F2 0B2"
    validate(fused)
    validate(everywhere)


def test_communication_between_i_and_w_does_not_stop_the_fusion() -> None:
    lowered = build_schedule("zb-v", 2, 4)
    assert "3I0 3SEND_B0@1 3RECV_F1@1 3W0" in lowered.format()
    fused = fuse_backward(lowered)
    validate(fused)
    assert "3B0 3SEND_B0@1 3RECV_F1@1 3LOAD1" in fused.format()
    comm = [op for stream in lowered.streams for op in stream if op.is_comm]
    assert [op for stream in fused.streams for op in stream if op.is_comm] == comm


@given(name=st.sampled_from(SPLIT), p=st.integers(1, 5), extra=st.integers(0, 8),
       where=st.sampled_from(["adjacent", "all"]))
def test_fused_schedules_stay_valid_and_do_the_same_work(name: str, p: int, extra: int,
                                                         where: str) -> None:
    m = 2 * p + extra
    compute = generate_schedule(name, p, m)
    fused = fuse_backward(compute, where=where)  # type: ignore[arg-type]
    validate(fused)
    validate(add_optimizer_step(lower(fused)))
    validate(fuse_backward(build_schedule(name, p, m), where=where))  # type: ignore[arg-type]
    assert sum(figures(simulate(fused)).busy) == sum(figures(simulate(compute)).busy)
    if where == "all":
        assert Kind.I not in _kinds(fused) and Kind.W not in _kinds(fused)


def test_wanted_narrows_the_choice_and_fused_schedules_pass_through() -> None:
    compute = generate_schedule("zb-v", 2, 4)
    only_stage_0 = fuse_backward(compute, where="all", wanted=lambda op: op.stage == 0)
    assert {op.stage for stream in only_stage_0.streams for op in stream
            if op.kind is Kind.I} == {1, 2, 3}
    assert fuse_backward(one_f_one_b(3, 5)) == one_f_one_b(3, 5)


def test_unknown_where_is_refused() -> None:
    with pytest.raises(ScheduleConfigError, match="use 'adjacent' or 'all'"):
        fuse_backward(one_f_one_b(2, 2), where="some")  # type: ignore[arg-type]
