"""Hand-made mutants the validator and the independent checker must both refuse.

Each is a property the seeded mutants of `test_validator_mutations` may miss: a rank left
without its STEP, and an overlapped pair whose backward waits on its own forward (issue 34).
"""

from __future__ import annotations

import pytest

from schedules import Kind, Schedule, build_schedule
from tests.support.validator_oracle import independent_verdict, validator_verdict


@pytest.mark.parametrize("check", ["validator", "checker"])
def test_both_refuse_a_rank_without_step(check: str) -> None:
    base = build_schedule("1f1b", 2, 2)
    streams = [list(s) for s in base.streams]
    streams[1] = [op for op in streams[1] if op.kind is not Kind.STEP]
    verdict = validator_verdict if check == "validator" else independent_verdict
    assert not verdict(streams, base.placement, 2)


def test_both_refuse_a_pair_whose_backward_waits_on_its_own_forward() -> None:
    # issue 34, item 4: B(0,0)'s gradient needs F(1,1), which needs the pair's F(0,1) output
    text = ("rank 0: 0LOAD0 0F0 0SEND_F0@1 0LOAD1 0F1 0SEND_F1@1 0RECV_B0@1 0OVERLAP_B0 "
            "0RECV_B1@1 0B1\n"
            "rank 1: 1RECV_F0@0 1LOAD0 1F0 1RECV_F1@0 1LOAD1 1F1 1B0 1SEND_B0@0 1B1 1SEND_B1@0")
    lowered = Schedule.from_text(text)
    for streams in (lowered.streams, lowered.compute_streams()):
        assert not independent_verdict(streams, (0, 1), 2)
        assert not validator_verdict(streams, (0, 1), 2)
