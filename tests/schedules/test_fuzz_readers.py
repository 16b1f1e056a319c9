"""Fuzz the schedule readers: `parse_instruction`, `parse_stream`, `Schedule.from_text`,
`parse_torch_csv` and `pipesched validate`'s file reader, on arbitrary text and on text made
of valid-looking tokens. Nothing escapes but `ScheduleError`, nothing hangs (each example
has a deadline), and whatever is accepted validates, lowers and simulates."""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli.validate_cmd import read_schedule_file
from schedules import (
    Schedule,
    ScheduleError,
    add_optimizer_step,
    lower,
    parse_instruction,
    parse_stream,
    parse_torch_csv,
    simulate,
    validate,
)
from tests.support.fuzz_counts import COUNTS, FUZZ_EXAMPLES

_KINDS = ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "LOAD", "REDUCE_GRAD",
          "STEP", "UNSHARD", "RESHARD", "Q", ""]
_FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=timedelta(seconds=5),
                 suppress_health_check=list(HealthCheck))


def _token(stage: int, kind: str, microbatch: int, peer: int, style: int) -> str:
    """A token that is valid, or wrong in one way (missing or extra field, odd number)."""
    stage_text = "" if style == 1 else str(stage)
    microbatch_text = "" if style == 2 else str(microbatch)
    peer_text = f"@{peer}" if kind.startswith(("SEND", "RECV")) != (style == 3) else ""
    return f"{stage_text}{kind}{microbatch_text}{peer_text}"


_NUMBERS = st.one_of(st.integers(0, 3), st.integers(0, 10**12))
tokens = st.builds(_token, _NUMBERS, st.sampled_from(_KINDS), _NUMBERS, _NUMBERS,
                   st.integers(0, 8))
lines = st.lists(st.lists(tokens, max_size=14).map(" ".join), min_size=1, max_size=4)
texts = st.one_of(st.text(max_size=120),
                  st.text(alphabet="0123456789FBIWSENDRCVLOAD_@:, \n()-;", max_size=120),
                  lines.map("\n".join),
                  lines.map(lambda rows: "\n".join(f"rank {r}: {row}"
                                                   for r, row in enumerate(rows))))


def _accepts(schedule: Schedule) -> None:
    """What the engine does with a user's schedule; only `ScheduleError` may come out."""
    validate(schedule)
    if not schedule.lowered:
        schedule = add_optimizer_step(lower(schedule)) if schedule.has_backward \
            else lower(schedule)
        validate(schedule)
    simulate(schedule)


@_FUZZ
@given(st.one_of(texts, tokens))
def test_fuzz_parse_instruction(text: str) -> None:
    COUNTS["parse_instruction"] += 1
    try:
        op = parse_instruction(text)
    except ScheduleError:
        return
    assert parse_instruction(str(op)) == op  # what parses prints back the same


@_FUZZ
@given(texts)
def test_fuzz_parse_stream(text: str) -> None:
    COUNTS["parse_stream"] += 1
    try:
        stream = parse_stream(text)
    except ScheduleError:
        return
    assert parse_stream(" ".join(map(str, stream))) == stream


@_FUZZ
@given(texts)
def test_fuzz_schedule_from_text(text: str) -> None:
    COUNTS["Schedule.from_text"] += 1
    try:
        _accepts(Schedule.from_text(text))
    except ScheduleError:
        pass


@_FUZZ
@given(st.one_of(texts.map(lambda t: t.replace(" ", ",")),
                 lines.map(lambda rows: "\n".join(",".join(row.split()) for row in rows))))
def test_fuzz_parse_torch_csv(text: str) -> None:
    COUNTS["parse_torch_csv"] += 1
    try:
        _accepts(parse_torch_csv(text))
    except ScheduleError:
        pass


@settings(_FUZZ, max_examples=FUZZ_EXAMPLES // 2)
@given(st.one_of(st.binary(max_size=200), texts.map(str.encode)), st.sampled_from([".txt",
                                                                                    ".csv"]))
def test_fuzz_validate_command_file(data: bytes, suffix: str) -> None:
    COUNTS["pipesched validate FILE"] += 1
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, f"schedule{suffix}")
        path.write_bytes(data)
        try:
            validate(read_schedule_file(path))
        except ScheduleError:
            pass
