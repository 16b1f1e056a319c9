"""Export a timeline as Chrome / Perfetto trace JSON: one process per rank, one event per op."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from schedules import KINDS, Instruction, Timeline
from schedules.ir.instructions import COMPUTE_KINDS
from viz.output import TRACE_FORMATS, check_output_path

__all__ = ["COMM_THREAD", "COMPUTE_THREAD", "trace_events", "write_trace"]

COMPUTE_THREAD = 0
"""Thread id of compute ops (F, B, I, W) in each rank's process."""
COMM_THREAD = 1
"""Thread id of everything else a measured run records (send/recv, reduce-grad, step)."""
_MICROSECONDS = {"s": 1e6, "units": 1e3}
"""Trace time is µs: a second is 1e6 µs; a cost-model unit is shown as 1 ms."""


def trace_events(timeline: Timeline) -> dict[str, Any]:
    """The trace as a JSON-ready dict in the Chrome trace-event format (object form).

    Every row becomes one complete ("X") event named by the op's text form (e.g. "2F0")
    with pid = rank and ts / dur in µs from the first op; "M" events name the processes
    ("rank r") and threads. Perfetto (ui.perfetto.dev) and chrome://tracing open it.
    """
    per_unit = _MICROSECONDS.get(timeline.unit, 1e3)
    origin = float(timeline.start.min()) if len(timeline) else 0.0
    ts = ((timeline.start - origin) * per_unit).tolist()
    dur = ((timeline.end - timeline.start) * per_unit).tolist()
    compute_codes = {code for code, kind in enumerate(KINDS) if kind in COMPUTE_KINDS}
    events: list[dict[str, Any]] = []
    for r in range(timeline.num_ranks):
        events.append({"name": "process_name", "ph": "M", "pid": r, "tid": COMPUTE_THREAD,
                       "args": {"name": f"rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r,
                       "tid": COMPUTE_THREAD, "args": {"sort_index": r}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": COMPUTE_THREAD,
                       "args": {"name": "compute"}})
    if not np.isin(timeline.kind, list(compute_codes)).all():
        events.extend({"name": "thread_name", "ph": "M", "pid": r, "tid": COMM_THREAD,
                       "args": {"name": "comm / other"}} for r in range(timeline.num_ranks))
    rows = zip(timeline.rank.tolist(), timeline.kind.tolist(), timeline.stage.tolist(),
               timeline.microbatch.tolist(), ts, dur)
    for rank, code, stage, microbatch, start, length in rows:
        kind = KINDS[code]
        events.append({
            "name": str(Instruction(kind, stage, microbatch)), "cat": kind.value, "ph": "X",
            "ts": start, "dur": length, "pid": rank,
            "tid": COMPUTE_THREAD if code in compute_codes else COMM_THREAD,
            "args": {"stage": stage, "microbatch": microbatch},
        })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": timeline.name, "num_ranks": timeline.num_ranks,
            "num_microbatches": timeline.num_microbatches, "chunks": timeline.chunks,
            "time_unit": "measured seconds, written as µs" if timeline.unit == "s"
            else "1 cost-model time unit is shown as 1 ms",
        },
    }


def write_trace(timeline: Timeline, path: str | os.PathLike[str]) -> Path:
    """Write `trace_events(timeline)` as JSON to `path` (which must end in .json)."""
    target = check_output_path(path, TRACE_FORMATS)
    with open(target, "w", encoding="utf-8") as file:
        json.dump(trace_events(timeline), file, separators=(",", ":"))
    return target
