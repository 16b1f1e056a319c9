"""Literal golden streams of the zero-bubble, V and breadth-first schedules for small cases."""

from __future__ import annotations

import pytest

from schedules import Schedule, build_schedule, generate_schedule

# (name, p, m, chunks, lowered) -> text. ZB-H1 p=3 is the paper's Fig. 3 (top) shape: each
# later rank holds back one more W for the cool-down. ZB-V and DualPipeV equal torch's
# ScheduleZBVZeroBubble / ScheduleDualPipeV orders (checked in
# tests/schedules/test_torch_tables.py).
GOLDEN = {
    ("zb-h1", 3, 4, None, False): """
rank 0: 0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
rank 1: 1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3
rank 2: 2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3
""",
    ("zb-h2", 2, 4, None, False): """
rank 0: 0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3
rank 1: 1F0 1I0 1F1 1I1 1F2 1I2 1W0 1F3 1I3 1W1 1W2 1W3
""",
    ("zb-v", 2, 3, None, False): """
rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2
rank 1: 1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2
""",
    ("dualpipev", 2, 4, None, False): """
rank 0: 0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3
rank 1: 1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3
""",
    ("looped-bfs", 2, 2, 2, False): """
rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
rank 1: 1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1
""",
    ("zb-h1", 2, 2, None, True): """
rank 0: 0LOAD0 0F0 0SEND_F0@1 0LOAD1 0F1 0SEND_F1@1 0RECV_B0@1 0I0 0W0 0RECV_B1@1 0I1 0W1 \
0REDUCE_GRAD STEP
rank 1: 1RECV_F0@0 1LOAD0 1F0 1RECV_F1@0 1I0 1SEND_B0@0 1LOAD1 1F1 1I1 1SEND_B1@0 1W0 1W1 \
1REDUCE_GRAD STEP
""",
}


@pytest.mark.parametrize(("key", "text"), GOLDEN.items(), ids=lambda x: str(x))
def test_golden(key: tuple[str, int, int, int | None, bool], text: str) -> None:
    name, p, m, chunks, lowered = key
    schedule = (build_schedule if lowered else generate_schedule)(name, p, m, chunks)
    assert schedule.format() == text.strip()
    again = Schedule.from_text(text, name=name, num_microbatches=m,
                               placement=schedule.placement)
    assert again == schedule
