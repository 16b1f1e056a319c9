"""Hypothesis properties of the GPipe, 1F1B and interleaved generators, lowering and simulator."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedules import (
    CostModel,
    Kind,
    ScheduleConfigError,
    build_schedule,
    figures,
    forward_only,
    generate_schedule,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    simulate,
    validate,
)

ranks = st.integers(1, 16)
microbatches = st.integers(1, 64)
chunks = st.integers(1, 4)
UNIT = CostModel(forward=1.0, backward=1.0, weight=0.0)


@given(p=ranks, m=microbatches, v=chunks, name=st.sampled_from(["gpipe", "1f1b", "interleaved"]))
def test_validator_accepts_every_generated_schedule(p: int, m: int, v: int, name: str) -> None:
    v = v if name == "interleaved" else 1
    compute = generate_schedule(name, p, m, v)
    validate(compute)
    validate(build_schedule(name, p, m, v))


@given(p=ranks, m=microbatches, v=chunks, name=st.sampled_from(["gpipe", "1f1b", "interleaved"]))
def test_every_op_once_on_its_owner(p: int, m: int, v: int, name: str) -> None:
    v = v if name == "interleaved" else 1
    schedule = generate_schedule(name, p, m, v)
    seen = [(op.kind, op.stage, op.microbatch) for rank, stream in enumerate(schedule.streams)
            for op in stream if schedule.placement[op.stage] == rank]
    assert sorted(seen, key=str) == sorted(
        [(kind, s, i) for kind in (Kind.F, Kind.B) for s in range(p * v) for i in range(m)],
        key=str)
    assert schedule.num_instructions == len(seen)


@given(p=ranks, m=microbatches, name=st.sampled_from(["gpipe", "1f1b"]))
def test_unit_costs_take_two_m_plus_p_minus_one(p: int, m: int, name: str) -> None:
    result = figures(simulate(build_schedule(name, p, m), UNIT))
    assert result.makespan == 2 * (m + p - 1)
    assert result.idle_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert result.bubble_rate == pytest.approx((p - 1) / (m + p - 1))


@given(p=ranks, groups=st.integers(1, 4), v=chunks)
def test_interleaved_bubble_is_megatron_formula(p: int, groups: int, v: int) -> None:
    m = groups * p
    costs = CostModel(forward=1.0 / v, backward=1.0 / v, weight=0.0)
    result = figures(simulate(build_schedule("interleaved", p, m, v), costs))
    assert result.makespan == pytest.approx((m + (p - 1) / v) * 2)


@given(p=ranks, m=microbatches)
def test_peak_activations(p: int, m: int) -> None:
    assert figures(simulate(gpipe(p, m))).peak_activations == (m,) * p
    peaks = figures(simulate(one_f_one_b(p, m))).peak_activations
    assert peaks == tuple(min(p - r, m) for r in range(p))


@given(p=ranks, m=microbatches, v=chunks)
def test_forward_only_has_no_backward_and_validates(p: int, m: int, v: int) -> None:
    schedule = build_schedule("forward-only", p, m, v)
    validate(schedule)
    kinds = {op.kind for stream in schedule.streams for op in stream}
    assert kinds <= {Kind.F, Kind.SEND_F, Kind.RECV_F, Kind.LOAD}
    result = figures(simulate(schedule, UNIT))
    assert result.busy == (float(m * v),) * p
    if v == 1:
        assert result.makespan == m + p - 1


@given(p=ranks, m=microbatches, v=chunks)
def test_lowering_adds_one_recv_per_send_and_a_step(p: int, m: int, v: int) -> None:
    schedule = build_schedule("interleaved", p, m, v)
    sends = sum(op.kind in (Kind.SEND_F, Kind.SEND_B) for s in schedule.streams for op in s)
    recvs = sum(op.kind in (Kind.RECV_F, Kind.RECV_B) for s in schedule.streams for op in s)
    cross_edges = (p * v - 1) * m * 2 if p > 1 else 0
    assert sends == recvs == cross_edges
    assert all(stream[-1].kind is Kind.STEP for stream in schedule.streams)
    reduces = [op.stage for s in schedule.streams for op in s if op.kind is Kind.REDUCE_GRAD]
    assert sorted(reduces) == list(range(p * v))


@given(p=ranks, m=microbatches, v=chunks, comm=st.floats(0, 3), forward=st.floats(0.1, 3))
def test_comm_delay_never_shortens_and_busy_is_exact(p: int, m: int, v: int, comm: float,
                                                     forward: float) -> None:
    schedule = build_schedule("interleaved", p, m, v)
    base = figures(simulate(schedule, CostModel(forward=forward, backward=2 * forward, weight=0)))
    slow = figures(simulate(schedule, CostModel(forward=forward, backward=2 * forward, weight=0,
                                                comm=comm)))
    assert slow.makespan >= base.makespan - 1e-9
    assert slow.busy == pytest.approx([3 * forward * m * v] * p)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: gpipe(0, 4), "num_ranks must be >= 1, got 0"),
    (lambda: one_f_one_b(4, 0), "num_microbatches must be >= 1, got 0"),
    (lambda: interleaved_1f1b(4, 8, 0), "chunks must be >= 1, got 0"),
    (lambda: forward_only(2, True), "num_microbatches must be an int"),
    (lambda: gpipe(2.0, 4), "num_ranks must be an int"),  # type: ignore[arg-type]
    (lambda: generate_schedule("pipedream", 4, 8), "unknown schedule 'pipedream'"),
    (lambda: generate_schedule("1f1b", 4, 8, 2), "takes chunks in 1, got 2"),
])
def test_generators_reject_bad_input(call: object, match: str) -> None:
    with pytest.raises(ScheduleConfigError, match=match):
        call()  # type: ignore[operator]


def test_cost_model_rejects_bad_costs() -> None:
    with pytest.raises(ScheduleConfigError, match="forward has 3 values"):
        simulate(gpipe(2, 2), CostModel(forward=[1.0, 1.0, 1.0]))
    with pytest.raises(ScheduleConfigError, match="backward must be finite and >= 0"):
        simulate(gpipe(2, 2), CostModel(backward=-1.0))
    with pytest.raises(ScheduleConfigError, match="comm must be finite"):
        CostModel(comm=float("nan"))
