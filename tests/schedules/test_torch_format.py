"""torch's schedule CSV, read and written without torch: mapping, round trips, errors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedules import (
    Kind,
    ScheduleParseError,
    ScheduleValidationError,
    build_schedule,
    format_torch_csv,
    from_torch_rows,
    generate_schedule,
    parse_torch_csv,
    simulate,
    validate,
)

NAMES = ["1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev", "looped-bfs"]


@given(name=st.sampled_from(NAMES), p=st.integers(1, 5), extra=st.integers(0, 6),
       lowered=st.booleans())
def test_our_schedules_round_trip_exactly(name: str, p: int, extra: int, lowered: bool) -> None:
    m = 2 * p + extra
    schedule = (build_schedule if lowered else generate_schedule)(name, p, m)
    text = format_torch_csv(schedule)
    assert "LOAD" not in text and "STEP" not in text and "@" not in text
    again = parse_torch_csv(text, name=schedule.name, num_microbatches=m,
                            placement=schedule.placement, lowered=schedule.lowered)
    assert again == schedule


def test_the_text_is_torchs() -> None:
    text = format_torch_csv(build_schedule("zb-h1", 2, 2))
    assert text.splitlines() == [
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0I0,0W0,0RECV_B1,0I1,0W1,0REDUCE_GRAD",
        "1RECV_F0,1F0,1RECV_F1,1I0,1SEND_B0,1F1,1I1,1SEND_B1,1W0,1W1,1REDUCE_GRAD",
    ]
    without = format_torch_csv(build_schedule("zb-h1", 2, 2), reduce_grad=False)
    assert "REDUCE_GRAD" not in without


def test_overlap_unshard_and_idle_slots() -> None:
    # A DualPipeV-style row with torch's FSDP actions and empty (idle) cells, p = 1, V placement.
    rows = [["0UNSHARD", "1UNSHARD", "0F0", "", "1F0", "(0F1;1B0)OVERLAP_F_B", "1F1", "1I1",
             None, "0B0", "0B1", "1W1", "0RESHARD", "1REDUCE_GRAD"]]
    schedule = from_torch_rows(rows)
    assert schedule.format() == "rank 0: 0F0 1F0 0F1 1B0 1F1 1I1 0B0 0B1 1W1"
    assert schedule.placement == (0, 0) and not schedule.lowered
    validate(schedule)


def test_rows_with_communication_become_a_lowered_schedule() -> None:
    text = ("0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD\n"
            "1RECV_F0,1F0,1B0,1SEND_B0,1REDUCE_GRAD\n")
    schedule = parse_torch_csv(text)
    assert schedule.lowered
    assert schedule.format().splitlines() == [
        "rank 0: 0LOAD0 0F0 0SEND_F0@1 0RECV_B0@1 0B0 0REDUCE_GRAD STEP",
        "rank 1: 1RECV_F0@0 1LOAD0 1F0 1B0 1SEND_B0@0 1REDUCE_GRAD STEP",
    ]
    validate(schedule)
    without_reduce = parse_torch_csv(text.replace(",0REDUCE_GRAD", "").replace(
        ",1REDUCE_GRAD", ""))
    assert without_reduce == schedule  # add_optimizer_step puts them at the same place


def test_torch_1f1b_table_off_by_one_is_rejected() -> None:
    # torch 2.13 `Schedule1F1B._get_pipeline_order` (its IR/visualizer table) numbers the
    # last rank's forwards from 1 (1F1 ... 1F4 for m = 4) and never runs 1F0; reading it
    # must fail loudly rather than simulate a wrong schedule.
    text = ("0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3,0REDUCE_GRAD\n"
            "1F1,1B0,1F2,1B1,1F3,1B2,1F4,1B3,1REDUCE_GRAD\n")
    with pytest.raises(ScheduleValidationError, match=r"microbatch 4 is outside 0\.\.3"):
        validate(parse_torch_csv(text, num_microbatches=4))


def test_simulating_a_loaded_schedule() -> None:
    schedule = parse_torch_csv(format_torch_csv(generate_schedule("zb-v", 3, 6)))
    assert schedule.placement == (0, 1, 2, 2, 1, 0)
    timeline = simulate(schedule)
    assert sum(1 for span in timeline.spans() if span.kind is Kind.W) == 6 * 6


@pytest.mark.parametrize(("text", "message"), [
    ("0F0,0X1\n", r"rank 0, column 1: cannot read torch action '0X1'"),
    ("0F\n", "'0F' needs a microbatch"),
    ("0F0,0B0,0REDUCE_GRAD3\n", "takes no microbatch"),
    ("0F0,0B0\n0F1\n", "stage 0 is computed on ranks 0 and 1"),
    ("0F0,0B0,2F0,2B0\n", r"no rank computes stages \[1\]"),
    ("0UNSHARD\n", "has no F, B, I or W action"),
    ("0F0,0SEND_F0\n", "stage 1 does not exist"),
])
def test_bad_text_names_the_cell_and_the_fix(text: str, message: str) -> None:
    with pytest.raises(ScheduleParseError, match=message):
        parse_torch_csv(text)
