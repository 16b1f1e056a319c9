"""Chrome / Perfetto trace export: one event per op, one process per rank."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from schedules import parse_instruction
from tests.support.viz_helpers import measured_timeline, simulated
from viz import OutputPathError, trace_events, write_trace


def test_simulated_trace_has_one_event_per_op_named_in_the_text_form(tmp_path: Path) -> None:
    timeline = simulated("interleaved", 4, 8, 2)
    path = write_trace(timeline, tmp_path / "t.json")
    trace = json.loads(path.read_text())
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == len(timeline)
    names = {e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(4)}
    assert Counter(e["pid"] for e in ops) == Counter(timeline.rank.tolist())
    spans = sorted(timeline.spans(), key=lambda s: (s.rank, s.start))
    ops.sort(key=lambda e: (e["pid"], e["ts"]))
    for span, event in zip(spans, ops):
        op = parse_instruction(event["name"])
        assert (op.kind, op.stage, op.microbatch) == (span.kind, span.stage, span.microbatch)
        assert event["ts"] == pytest.approx(span.start * 1e3)  # a unit shows as 1 ms
        assert event["dur"] == pytest.approx((span.end - span.start) * 1e3)


def test_measured_trace_in_microseconds_with_comm_on_its_own_thread() -> None:
    timeline = measured_timeline()
    ops = [e for e in trace_events(timeline)["traceEvents"] if e["ph"] == "X"]
    assert len(ops) == len(timeline)
    assert min(e["ts"] for e in ops) == 0
    first_b = next(e for e in ops if e["name"] == "1B0")
    assert first_b["dur"] == pytest.approx(4000.0, abs=0.5)  # 4 ms (epoch floats: ~0.1 µs)
    assert {e["tid"] for e in ops if e["cat"] in ("SEND_F", "RECV_B", "STEP")} == {1}
    assert {e["tid"] for e in ops if e["cat"] in ("F", "B")} == {0}


def test_trace_path_must_end_in_json(tmp_path: Path) -> None:
    with pytest.raises(OutputPathError, match=r"\.json"):
        write_trace(simulated("1f1b", 2, 2), tmp_path / "t.png")
