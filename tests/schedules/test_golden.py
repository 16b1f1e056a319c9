"""Literal golden streams for small cases, in the text form that parses back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedules import (
    Instruction,
    Kind,
    Schedule,
    ScheduleParseError,
    build_schedule,
    generate_schedule,
    parse_instruction,
    parse_stream,
)

GOLDEN = {
    ("1f1b", 2, 2, 1, True): """
rank 0: 0LOAD0 0F0 0SEND_F0@1 0LOAD1 0F1 0SEND_F1@1 0RECV_B0@1 0B0 0RECV_B1@1 0B1 0REDUCE_GRAD STEP
rank 1: 1RECV_F0@0 1LOAD0 1F0 1RECV_F1@0 1B0 1SEND_B0@0 1LOAD1 1F1 1B1 1SEND_B1@0 1REDUCE_GRAD STEP
""",
    ("gpipe", 2, 2, 1, True): """
rank 0: 0LOAD0 0F0 0SEND_F0@1 0LOAD1 0F1 0SEND_F1@1 0RECV_B0@1 0B0 0RECV_B1@1 0B1 0REDUCE_GRAD STEP
rank 1: 1RECV_F0@0 1LOAD0 1F0 1RECV_F1@0 1LOAD1 1F1 1B0 1SEND_B0@0 1B1 1SEND_B1@0 1REDUCE_GRAD STEP
""",
    ("1f1b", 4, 2, 1, False): """
rank 0: 0F0 0F1 0B0 0B1
rank 1: 1F0 1F1 1B0 1B1
rank 2: 2F0 2F1 2B0 2B1
rank 3: 3F0 3B0 3F1 3B1
""",
    ("interleaved", 2, 2, 2, False): """
rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1
""",
    ("forward-only", 3, 2, 1, True): """
rank 0: 0LOAD0 0F0 0SEND_F0@1 0LOAD1 0F1 0SEND_F1@1
rank 1: 1RECV_F0@0 1F0 1RECV_F1@0 1SEND_F0@2 1F1 1SEND_F1@2
rank 2: 2RECV_F0@1 2F0 2RECV_F1@1 2F1
""",
}


@pytest.mark.parametrize("key", sorted(GOLDEN, key=str))
def test_golden_stream(key: tuple[str, int, int, int, bool]) -> None:
    name, p, m, v, lowered = key
    make = build_schedule if lowered else generate_schedule
    schedule = make(name, p, m, v)
    assert schedule.format() == GOLDEN[key].strip()
    back = Schedule.from_text(GOLDEN[key], name=name, num_microbatches=m)
    assert back.streams == schedule.streams
    assert back.placement == schedule.placement
    assert back.lowered == lowered


kinds = st.sampled_from(list(Kind))
numbers = st.integers(0, 10_000)


@st.composite
def instructions(draw: st.DrawFn) -> Instruction:
    kind = draw(kinds)
    if kind is Kind.STEP:
        return Instruction(kind)
    if kind is Kind.REDUCE_GRAD:
        return Instruction(kind, draw(numbers))
    peer = draw(numbers) if kind.value.startswith(("SEND", "RECV")) else -1
    return Instruction(kind, draw(numbers), draw(numbers), peer)


@given(st.lists(instructions(), max_size=30))
def test_text_form_round_trips(stream: list[Instruction]) -> None:
    text = " ".join(map(str, stream))
    assert "\n" not in text
    assert parse_stream(text) == tuple(stream)


@given(st.text(max_size=20))
def test_parser_raises_only_its_own_error(text: str) -> None:
    try:
        parse_instruction(text)
    except ScheduleParseError:
        pass


@pytest.mark.parametrize("text", ["F0", "2F", "1SEND_F0", "STEP3", "2X0", "", "1REDUCE_GRAD3",
                                  "-1F0", "1F0@2"])
def test_parser_rejects(text: str) -> None:
    with pytest.raises(ScheduleParseError, match=r"parse instruction|does not have the form"):
        parse_instruction(text)
