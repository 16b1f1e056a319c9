"""The validator catches hand-made broken schedules and says where, with the grid."""

from __future__ import annotations

import pytest

from schedules import Schedule, ScheduleValidationError, build_schedule, lower, validate

ONE_F_ONE_B = build_schedule("1f1b", 2, 2).format()


def edited(text: str, rank: int, old: str, new: str) -> Schedule:
    lines = text.splitlines()
    assert old in lines[rank]
    lines[rank] = lines[rank].replace(old, new, 1)
    return Schedule.from_text("\n".join(lines), name="broken", num_microbatches=2,
                              placement=(0, 1))


CASES = {
    "receives out of order": (edited(ONE_F_ONE_B, 0, "0RECV_B0@1 0B0 0RECV_B1@1",
                                     "0RECV_B1@1 0B0 0RECV_B0@1"), "receives out of order"),
    "missing backward": (edited(ONE_F_ONE_B, 0, " 0B1", ""), "needs exactly F\\+B"),
    "duplicate forward": (edited(ONE_F_ONE_B, 0, "0F1 ", "0F1 0F1 "), "appears twice"),
    "wrong peer": (edited(ONE_F_ONE_B, 0, "0SEND_F0@1", "0SEND_F0@0"), "peer 0 is wrong"),
    "op on wrong rank": (edited(ONE_F_ONE_B, 0, "0B1", "1B1"), "belongs to rank 1"),
    "microbatch out of range": (edited(ONE_F_ONE_B, 0, "0LOAD1", "0LOAD7"), "outside 0..1"),
    "missing load": (edited(ONE_F_ONE_B, 0, "0LOAD1 ", ""), "before LOAD"),
    "send before compute": (edited(ONE_F_ONE_B, 0, "0F1 0SEND_F1@1", "0SEND_F1@1 0F1"),
                            "sends before F"),
    "unmatched send": (edited(ONE_F_ONE_B, 1, "1RECV_F1@0 ", ""), "before its input|matching"),
    # Both ranks pair up correctly but under blocking semantics rank 0 waits for a
    # gradient that rank 1 can only produce after receiving rank 0's second activation.
    "rendezvous deadlock": (edited(ONE_F_ONE_B, 0, "0SEND_F1@1 0RECV_B0@1",
                                   "0RECV_B0@1 0SEND_F1@1"), "deadlock under blocking"),
    "step not last": (edited(ONE_F_ONE_B, 0, "0REDUCE_GRAD STEP", "STEP 0REDUCE_GRAD"),
                      "STEP must be the rank's last"),
    "reduce before last backward": (edited(ONE_F_ONE_B, 1, "1B1 1SEND_B1@0 1REDUCE_GRAD",
                                           "1REDUCE_GRAD 1B1 1SEND_B1@0"),
                                    "REDUCE_GRAD of stage 1 before"),
    # Regressions (issue 22): each was accepted before.
    "rank with no step": (edited(ONE_F_ONE_B, 1, " STEP", ""), "has no STEP"),
    "rank 0 with no step": (edited(ONE_F_ONE_B, 0, " STEP", ""), "has no STEP"),
    "duplicated reduce_grad": (edited(ONE_F_ONE_B, 0, "0REDUCE_GRAD", "0REDUCE_GRAD 0REDUCE_GRAD"),
                               "REDUCE_GRAD of stage 0 appears twice"),
    "reduce_grad on one rank only": (edited(edited(ONE_F_ONE_B, 0, " STEP", "").format(), 1,
                                            " 1REDUCE_GRAD STEP", ""), "has no STEP"),
}
ZB_H1 = build_schedule("zb-h1", 2, 2).format()


def _unstepped(text: str) -> str:
    return "\n".join(line.replace(" 0REDUCE_GRAD STEP", "").replace(" 1REDUCE_GRAD STEP", "")
                      for line in text.splitlines())


# A W before its I, in a lowered stream without the optimizer part (which would otherwise
# notice the incomplete weight gradient at REDUCE_GRAD) and with it.
CASES["w before its i, not stepped"] = (edited(_unstepped(ZB_H1), 0, "0I0 0W0", "0W0 0I0"),
                                        "W\\(0,0\\) runs before I\\(0,0\\)")
CASES["w before its i"] = (edited(ZB_H1, 0, "0I0 0W0", "0W0 0I0"),
                           "W\\(0,0\\) runs before I\\(0,0\\)")


@pytest.mark.parametrize("case", sorted(CASES))
def test_validator_catches(case: str) -> None:
    schedule, message = CASES[case]
    with pytest.raises(ScheduleValidationError, match=message) as caught:
        validate(schedule)
    error = caught.value
    assert error.rank is not None and error.step is not None
    marked = f"[{schedule.streams[error.rank][error.step]}]"
    assert marked in str(error), "the grid marks the failing step"
    assert f">rank {error.rank}" in str(error)


def test_compute_order_deadlock_is_caught_before_lowering() -> None:
    # Rank 1 runs B0 before F0 has arrived: its backward waits on its own later forward.
    schedule = Schedule.from_text("0F0 0B0\n1B0 1F0", name="broken")
    with pytest.raises(ScheduleValidationError, match="deadlock") as caught:
        validate(schedule)
    assert "[1B0]" in str(caught.value)
    with pytest.raises(ScheduleValidationError, match="cannot run"):
        lower(schedule)


def test_cross_rank_cycle_is_a_deadlock() -> None:
    # Rank 0 waits for the gradient of microbatch 1 before running forward 1 that feeds it.
    schedule = Schedule.from_text("0F0 0B1 0F1 0B0\n1F0 1F1 1B1 1B0", name="cycle")
    with pytest.raises(ScheduleValidationError, match="deadlock"):
        validate(schedule)


def test_validated_schedules_pass() -> None:
    validate(build_schedule("interleaved", 3, 5, 2))


@pytest.mark.parametrize("text", ["37066896F0", "0F0 0B0 0F999999999999 0B999999999999",
                                  "0F0 0B0\n5000000000F0"])
def test_huge_stage_or_microbatch_index_is_refused_quickly(text: str) -> None:
    """Regression: a text naming stage 37066896 built a 37M-entry placement and the coverage
    check walked S·m pairs (found by fuzzing with a newer hypothesis)."""
    import signal

    from schedules import ScheduleError, parse_torch_csv

    def hung(*_: object) -> None:
        raise AssertionError("the readers or the validator hung on a huge index")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)  # a hang guard, not a speed check: the fixed code answers at once
    try:
        for read in (Schedule.from_text, lambda t: parse_torch_csv(t.replace(" ", ","))):
            with pytest.raises(ScheduleError):
                validate(read(text))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
