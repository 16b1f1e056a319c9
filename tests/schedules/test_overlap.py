"""The overlapped F&B pair (OVERLAP_B): text and torch forms, validation, and DualPipe's bubble."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    CostModel,
    Instruction,
    Kind,
    Schedule,
    ScheduleConfigError,
    ScheduleValidationError,
    add_optimizer_step,
    build_schedule,
    dualpipev,
    figures,
    format_torch_csv,
    from_torch_rows,
    lower,
    parse_instruction,
    parse_torch_csv,
    simulate,
    validate,
)


def test_text_form_parses_back() -> None:
    op = Instruction(Kind.OVERLAP_B, 3, 1)
    assert str(op) == "3OVERLAP_B1"
    assert parse_instruction("3OVERLAP_B1") == op


@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 4), (3, 7), (4, 8)])
def test_dualpipev_overlap_round_trips_and_lowers(p: int, m: int) -> None:
    compute = dualpipev(p, m, overlap=True)
    assert any(op.kind is Kind.OVERLAP_B for stream in compute.streams for op in stream) \
        or p == 1
    lowered = build_schedule("dualpipev-overlap", p, m)
    for schedule in (compute, lowered):
        validate(schedule)
        assert Schedule.from_text(schedule.format(), name=schedule.name,
                                  num_microbatches=m) == schedule
    assert parse_torch_csv(format_torch_csv(compute), name=compute.name, num_microbatches=m,
                           overlap=True) == compute
    plain = parse_torch_csv(format_torch_csv(compute), name="dualpipev", num_microbatches=m)
    assert plain == dualpipev(p, m)  # default reading: the pair as two plain actions
    validate(parse_torch_csv(format_torch_csv(lowered), num_microbatches=m, overlap=True))


@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 4), (3, 6), (4, 8), (4, 12), (5, 13)])
def test_equals_torchs_dualpipev_with_its_overlap_f_b_pairs(p: int, m: int) -> None:
    torch_helpers = pytest.importorskip("tests.support.torch_helpers")
    rows = torch_helpers.torch_rows("DualPipeV", p, m, with_comms=False)
    assert from_torch_rows(rows, name="dualpipev-overlap", num_microbatches=m,
                           overlap=True) == dualpipev(p, m, overlap=True)


costs = st.sampled_from([0.5, 1.0, 1.5, 2.0])


@settings(max_examples=30, deadline=None)
@given(p=st.integers(2, 6), extra=st.integers(0, 6), forward=costs,
       weight=st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0]),
       overlap=st.sampled_from([0.6, 0.7, 0.8, 0.9, 1.0]))
def test_bubble_is_dualpipes_formula(p: int, extra: int, forward: float, weight: float,
                                     overlap: float) -> None:
    # DeepSeek's DualPipe README: bubble (PP/2 - 1)(F&B + B - 3W) for PP devices, i.e.
    # (p - 1)(F&B + B - 3W) for DualPipeV's p ranks (2p chunks); B is the full backward
    # and F&B the overlapped pair: overlap × (F + B). Read off the most idle rank; it
    # holds in the formula's regime: the input gradient costs what the forward does, W is
    # no longer than F and small enough to fill the cool-down (3W <= F&B + B), and the pair
    # takes at least as long as its longer half (as any real overlap does). Outside it
    # (e.g. F=0.5, I=1, W=0.5) the simulator predicts less idle than the formula.
    backward = forward
    full = backward + weight
    pair = overlap * (forward + full)
    if weight > forward or 3 * weight > pair + full or pair < max(forward, full):
        return
    m = 2 * p + extra
    cost = CostModel(forward=forward, backward=backward, weight=weight, overlap=overlap)
    result = figures(simulate(dualpipev(p, m, overlap=True), cost))
    idle = max(result.makespan - busy for busy in result.busy)
    assert idle == pytest.approx((p - 1) * (pair + full - 3 * weight))


def test_overlap_cuts_dualpipev_time_where_the_pair_is_cheaper() -> None:
    # Issue 14: back to back, DualPipeV at p=4, m=8 takes 51 units whatever the overlap.
    cost = CostModel(overlap=0.7)
    assert figures(simulate(dualpipev(4, 8), cost)).makespan == 51.0
    assert figures(simulate(dualpipev(4, 8, overlap=True), cost)).makespan == \
        pytest.approx(45.0)


@pytest.mark.parametrize(("text", "message"), [
    ("0F0 0OVERLAP_B0", "of another microbatch"),
    ("0OVERLAP_B0 0F0", "right after such an F"),
])
def test_validator_refuses_a_pair_that_cannot_overlap(text: str, message: str) -> None:
    schedule = Schedule.from_text(text, num_microbatches=1)
    with pytest.raises(ScheduleValidationError, match=message):
        validate(schedule)


def test_a_lowered_pair_still_runs_after_fusing_nothing() -> None:
    schedule = add_optimizer_step(lower(dualpipev(3, 6, overlap=True)))
    validate(schedule)


def test_bad_overlap_is_refused() -> None:
    with pytest.raises(ScheduleConfigError, match="overlap must be"):
        CostModel(overlap=-0.5)


# Issue 34, item 4: the pair below is F(0,1) overlapped with B(0,0), whose gradient comes
# from B(1,0), which rank 1 runs after F(1,1), which needs the pair's own F output. Run as
# one op (both outputs leave when the pair ends) it waits forever; the validator used to
# accept it because it ran the F, sent its output, then received the gradient.
_PAIR_WAITS_ON_ITSELF = """\
rank 0: 0LOAD0 0F0 0SEND_F0@1 0LOAD1 0F1 0SEND_F1@1 0RECV_B0@1 0OVERLAP_B0 0RECV_B1@1 0B1
rank 1: 1RECV_F0@0 1LOAD0 1F0 1RECV_F1@0 1LOAD1 1F1 1B0 1SEND_B0@0 1B1 1SEND_B1@0"""


def test_a_lowered_pair_cannot_wait_on_its_own_forward_output() -> None:
    schedule = Schedule.from_text(_PAIR_WAITS_ON_ITSELF)
    with pytest.raises(ScheduleValidationError, match="overlapped pair"):
        validate(schedule)
    with pytest.raises(ScheduleValidationError, match="waits forever"):
        simulate(schedule)
    compute_only = Schedule("pair", 2, (0, 1), schedule.compute_streams())
    with pytest.raises(ScheduleValidationError):
        validate(compute_only)


def _runs(schedule: Schedule) -> bool:
    try:
        simulate(schedule)
    except ScheduleValidationError:
        return False
    return True


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6)])
def test_validator_and_simulator_agree_on_what_a_pair_may_wait_for(p: int, m: int) -> None:
    """Move each RECV of a lowered DualPipeV-with-pairs to every place in its rank: every
    order the validator accepts, the simulator runs, and the lowering's own order is one."""
    base = lower(dualpipev(p, m, overlap=True))
    validate(base)
    accepted = refused_by_pair = 0
    for rank, stream in enumerate(base.streams):
        recvs = [k for k, op in enumerate(stream) if op.kind is Kind.RECV_B]
        for k in recvs:
            for place in range(max(0, k - 6), min(len(stream), k + 7)):
                ops = list(stream)
                ops.insert(place, ops.pop(k))
                streams = list(base.streams)
                streams[rank] = tuple(ops)
                mutant = base.replace_streams(tuple(streams))
                try:
                    validate(mutant)
                except ScheduleValidationError as error:
                    refused_by_pair += "overlapped pair" in str(error)
                    continue
                accepted += 1
                assert _runs(mutant), f"validator accepts, simulator stalls:\n{mutant.format()}"
    assert accepted and refused_by_pair  # both verdicts are exercised
