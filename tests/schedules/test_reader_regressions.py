"""Regressions of the schedule readers (issue 16, item 7): each test is named after the bug."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    Schedule,
    ScheduleParseError,
    ScheduleValidationError,
    build_schedule,
    parse_torch_csv,
    validate,
)


@pytest.mark.parametrize(("text", "found"), [
    ("0F0 0I0", r"has F\+I;"),  # W missing
    ("0F0 0W0", r"has F\+W;"),  # I missing: the W runs without its I
    ("0F0 0W0 0I0 0F1 0B1", "deadlock"),  # W before I: an order that cannot run
    ("0F0 0F1 0I0 0W0 0I1\n", r"microbatch 1 has F\+I;"),
])
def test_split_backward_with_w_missing_or_before_i_is_no_typeerror(text: str,
                                                                   found: str) -> None:
    # Was: TypeError "'<' not supported between instances of 'Kind' and 'Kind'".
    for read in (Schedule.from_text, lambda t: parse_torch_csv(t.replace(" ", ","))):
        with pytest.raises(ScheduleValidationError, match=found):
            validate(read(text))


def test_split_backward_with_w_missing_points_at_the_i() -> None:
    schedule = Schedule.from_text("rank 0: 0F0 0I0 0F1 0B1\nrank 1: 1F0 1B0 1F1 1B1")
    with pytest.raises(ScheduleValidationError) as raised:
        validate(schedule)
    assert (raised.value.rank, raised.value.step) == (0, 1)
    assert "needs exactly F+B or F+I+W" in str(raised.value)


def test_swapped_rank_labels_are_refused_not_ignored() -> None:
    # Was: accepted, each line taken as the rank of its position whatever its label said.
    with pytest.raises(ScheduleParseError, match=r"line 1 is labelled 'rank 1'.*in order"):
        Schedule.from_text("rank 1: 0F0 0B0\nrank 0: 1F0 1B0")


@pytest.mark.parametrize(("text", "message"), [
    ("rank 0: 0F0 0B0\n\nrank 2: 1F0 1B0", "line 3 is labelled 'rank 2'"),
    ("rank 0: 0F0 0B0\nrank 0: 1F0 1B0", "line 2 is labelled 'rank 0'"),
    pytest.param("rank 9" + "9" * 5000 + ": 0F0 0B0", r"labelled 'rank 999999999999\.\.\.'",
                 id="a 5001-digit label"),
    ("stage 0: 0F0 0B0", "'stage 0' before ':' is not a rank label"),
])
def test_rank_labels_that_disagree_with_the_order_are_refused(text: str, message: str) -> None:
    with pytest.raises(ScheduleParseError, match=message):
        Schedule.from_text(text)


def test_rank_labels_in_order_still_parse() -> None:
    labelled = Schedule.from_text("RANK 0: 0F0 0B0\n  rank 01 : 1F0 1B0\n")
    plain = Schedule.from_text("0F0 0B0\n1F0 1B0")
    assert labelled.streams == plain.streams and labelled.placement == (0, 1)


@settings(max_examples=30)
@given(st.integers(2, 4), st.integers(1, 4), st.permutations(range(4)))
def test_a_formatted_schedule_parses_back_only_in_rank_order(p: int, m: int,
                                                             order: list[int]) -> None:
    schedule = build_schedule("1f1b", p, m)
    lines = schedule.format().splitlines()
    ranks = [r for r in order if r < p]
    text = "\n".join(lines[r] for r in ranks)
    if ranks == sorted(ranks):
        assert Schedule.from_text(text, num_microbatches=m).streams == schedule.streams
    else:
        with pytest.raises(ScheduleParseError, match="list the ranks in order"):
            Schedule.from_text(text, num_microbatches=m)


def test_validating_a_lowered_schedule_scans_for_backward_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Was: `has_backward` (a scan of every instruction) ran for each loaded forward, so a
    # lowered GPipe of p=30, m=3000 took 11 s to validate instead of 2 s.
    schedule = build_schedule("gpipe", 3, 40)
    scans = []
    original = Schedule.has_backward

    def counted(self: Schedule) -> bool:
        scans.append(1)
        return bool(original.fget(self))  # type: ignore[attr-defined]

    monkeypatch.setattr(Schedule, "has_backward", property(counted))
    validate(schedule)
    assert len(scans) <= 2
