"""Peak activations of the schedules whose peak is a closed form of p, m and v, so the search
prices their memory without building the schedule (at 3,072 devices one holds ~10^5 ops).

Legend: p ranks, m microbatches, v chunks per rank, rank r (0 first); a rank's "count" is
the (stage, microbatch) activations it holds at once (F adds one; the last backward op, B or
W, frees it: `schedules.analysis.accounting.HeldTrace`). Each form below follows from the
generator's order; tests/planner/test_peaks.py checks every one against the built
schedule's trace for many p, m, v and per-stage sizes.

- gpipe (`schedules/generators/classic.py`): every F before any B, so all m at once.
- 1f1b: rank r's warm-up runs p - r - 1 forwards, then one more before its first B, and
  steady 1F1B keeps that count: min(p - r, m).
- zb-h1, zb-h2 (`zb_h1_h2.py`, `extra` 1 and 2): rank r warms up with extra·(p - 1 - r)
  forwards, runs one more before its first I, and holds back extra·r W passes (a
  microbatch is freed by its W): extra·(p - 1) + 1 at once, at most m; min(p, m) and
  min(2p - 1, m) on every rank.
- looped-bfs (`looped_bfs.py`): every chunk's m forwards before any backward: all v·m.

With one stage per rank (v = 1), or all of a rank's activations held at once (looped-bfs),
the bytes at the peak are the count times each stage's size, whatever the sizes: exact.
The V-shaped and interleaved schedules hold a mix of chunks that depends on the sizes; they
keep their traces, and zb-v and dualpipev get a lower bound from their step tables (what a
rank holds when it first frees an activation, `warm_up_held`) for the search's memory floor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from schedules import SCHEDULES
from schedules.ir.limits import ScheduleTooLargeError, check_schedule_size

__all__ = ["CLOSED_FORMS", "WARM_UP_FORMS", "PeakCounts", "closed_form_peaks",
           "same_trace_as", "warm_up_held"]

_PerStage = Callable[[int, int, int, int], int]
"""(p, m, v, rank) -> microbatches of each of the rank's stages held at the rank's peak."""

CLOSED_FORMS: dict[str, _PerStage] = {
    "gpipe": lambda p, m, v, r: m,
    "1f1b": lambda p, m, v, r: min(p - r, m),
    "zb-h1": lambda p, m, v, r: min(p, m),
    "zb-h2": lambda p, m, v, r: min(2 * p - 1, m),
    "looped-bfs": lambda p, m, v, r: m,
}
"""The schedules whose peak is a closed form; every one accepts any p, m >= 1 (and v >= 1
for looped-bfs) up to the package's size limit."""

_WarmUp = Callable[[int, int], tuple[int, int]]
"""(p, rank) -> the chunk-0 and chunk-1 forwards a rank runs before its first release."""

WARM_UP_FORMS: dict[str, _WarmUp] = {
    # zb_v._steps: warm-up 1 runs 2(p-r)-1 F0, warm-up 2 r × "F1 F0", warm-up 3 opens with
    # F1 I1 W1; the W frees the first
    "zb-v": lambda p, r: (2 * p - r - 1, r + 1),
    # dualpipe._steps: step 1 runs 2(p-r-1) F0, step 2 (r+1) × "F0 F1"; step 3 opens with
    # I1 W (r < p-1), or (r = p-1, no step 3) step 4 with F0 B1
    "dualpipev": lambda p, r: (2 * p - r - 1 + (r == p - 1), r + 1),
}
"""V-shaped schedules whose held activations at their first release (a lower bound on the
peak, not the peak: later the mix of chunks may weigh more) follow from the step table;
ops of microbatches >= m are dropped, so each count is at most m."""

_SAME_TRACE = {"dualpipev-overlap": "dualpipev"}
"""Schedules whose held trace is another's: dualpipev-overlap is dualpipev with some fused
B turned into OVERLAP_B (`dualpipe._pair_up`), which frees the same activations at the same
place in the same order."""


def same_trace_as(name: str) -> str:
    """The schedule whose held trace `name` shares (itself when none)."""
    return _SAME_TRACE.get(name, name)


@dataclass(frozen=True)
class PeakCounts:
    """At each rank's peak, how many microbatches of each stage it holds; duck-types
    `HeldTrace.peak_bytes` for `PlanContext.memory`."""

    placement: tuple[int, ...]
    held: np.ndarray
    """Per stage: microbatches of it held when its rank peaks."""

    def peaks(self) -> tuple[int, ...]:
        """Most (stage, microbatch) activations each rank holds at once."""
        counts = np.bincount(self.placement, weights=self.held,
                             minlength=max(self.placement) + 1)
        return tuple(int(x) for x in counts)

    def peak_bytes(self, stage_bytes: ArrayLike) -> np.ndarray:
        """Most activation bytes each rank holds at once, one microbatch of stage s being
        `stage_bytes[s]` (>= 0)."""
        return np.bincount(self.placement, weights=self.held * np.asarray(stage_bytes, float),
                           minlength=max(self.placement) + 1)


def closed_form_peaks(name: str, p: int, m: int, v: int) -> PeakCounts | None:
    """The peak of schedule `name` on p ranks, m microbatches, v chunks per rank in closed
    form; None when it has none, or when the schedule would refuse these sizes (too large to
    build: the generator refuses those too)."""
    form = CLOSED_FORMS.get(name)
    low, high = SCHEDULES[name].chunks if name in SCHEDULES else (1, 1)
    if form is None or v < low or (high is not None and v > high):
        return None
    try:
        check_schedule_size(p, m, v, lowered=False)
    except ScheduleTooLargeError:
        return None
    placement = SCHEDULES[name].placement(p, v)
    held = np.array([form(p, m, v, rank) for rank in placement], dtype=float)
    return PeakCounts(placement, held)


def warm_up_held(name: str, p: int, m: int, v: int) -> PeakCounts | None:
    """What each rank of V-shaped schedule `name` (zb-v, dualpipev and its overlapped
    variant) holds when it first frees an activation: no more than its peak, for a memory
    floor before the schedule is built; None for the other schedules."""
    form = WARM_UP_FORMS.get(same_trace_as(name))
    if form is None or v != 2 or (same_trace_as(name) == "dualpipev" and m < 2 * p):
        return None  # none, or dualpipev refuses m < 2p: left to the schedule to say
    placement = SCHEDULES[name].placement(p, v)
    held = np.zeros(2 * p)
    for rank in range(p):
        down, up = form(p, rank)
        held[rank], held[2 * p - 1 - rank] = min(down, m), min(up, m)
    return PeakCounts(placement, held)
