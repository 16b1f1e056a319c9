"""Emulated all-to-all lane: exchanges queue one at a time; a wait already over costs nothing."""

from __future__ import annotations

import pytest

from pipeline.errors import PipelineConfigError
from pipeline.rehearsal.emulated import WallClock
from pipeline.rehearsal.emulated_moe import AllToAllLane, EmulatedAllToAll


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


def _clock(time: FakeTime) -> WallClock:
    return WallClock(spin_limit=0.0, carry_window=0.0, now=time.now, sleep=time.sleep)


def test_exchanges_run_one_at_a_time_in_launch_order() -> None:
    time = FakeTime()
    lane = AllToAllLane(_clock(time))
    first, second = lane.launch(2.0), lane.launch(3.0)
    assert (first.deadline, second.deadline) == (2.0, 5.0)  # the second waits for the first
    time.t = 1.0
    first.wait()
    assert time.t == pytest.approx(2.0)
    time.t = 7.0  # computed past both: waiting costs nothing
    second.wait()
    assert time.t == 7.0
    assert lane.launch(1.0).deadline == 8.0  # the lane was free: it starts now


def test_bad_exchange_time_is_refused() -> None:
    with pytest.raises(PipelineConfigError, match="finite number of seconds"):
        EmulatedAllToAll(-1.0, 0.0)
