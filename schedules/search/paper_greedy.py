"""The Zero Bubble paper's greedy scheduler: one chunk per rank, real costs, a memory limit.

Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3.2 ("automatic scheduling"):
    1. warm-up: within the memory limit, schedule as many F as possible before the first B;
    2. steady: schedule one F and one B in turn; insert W to fill a wait for an F or B
       ("a gap larger than T_W"), and to free memory when the limit is hit;
    3. schedule every remaining W.
The paper's B is our I (input gradient only). The order comes from a list scheduler that
runs the ranks against simulated time, so waits and gaps are known when it decides.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from

__all__ = ["GreedyKnobs", "greedy_order"]

_F, _I, _W = Kind.F, Kind.I, Kind.W
_UNKNOWN = -1.0  # end time of an op not scheduled yet


@dataclass(frozen=True, kw_only=True)
class GreedyKnobs:
    """The heuristic's choices that `zb_auto` searches over."""

    input_grad_first: bool = True
    """Run a ready I before a ready F always (True) or only after an F (strict F/I turns)."""
    min_gap_for_w: float = 0.0
    """Fill a wait with W only if the wait is at least this many W times (0: any wait)."""
    lookahead: bool = False
    """In a wait for an I known to arrive before an F could end, do not start that F (the
    paper's binary warm-up knob: an extra F may delay the first B)."""

    def label(self) -> str:
        return (f"greedy(i_first={int(self.input_grad_first)}, w_gap={self.min_gap_for_w:g}, "
                f"lookahead={int(self.lookahead)})")


def greedy_order(num_microbatches: int, memory_limit: int, forward: Sequence[float],
                 backward: Sequence[float], weight: Sequence[float], delay: Sequence[float],
                 knobs: GreedyKnobs = GreedyKnobs()) -> tuple[tuple[Instruction, ...], ...]:
    """Per-rank compute streams for p = len(forward) stages, stage r on rank r.

    `delay[s]` is the comm delay on the s -> s+1 edge. No rank ever holds more than
    `memory_limit` microbatches (F started, W not yet run). Costs must be >= 0.
    """
    return _Greedy(num_microbatches, memory_limit, forward, backward, weight, delay, knobs).run()


class _Greedy:
    # Legend: p ranks = stages, m microbatches; per rank, F and I run in microbatch order
    # and W in the order of the I's. f_end/i_end hold end times (_UNKNOWN until scheduled).

    def __init__(self, m: int, limit: int, forward: Sequence[float], backward: Sequence[float],
                 weight: Sequence[float], delay: Sequence[float], knobs: GreedyKnobs) -> None:
        self.m, self.limit, self.knobs = m, limit, knobs
        self.forward, self.backward, self.weight, self.delay = forward, backward, weight, delay
        p = self.p = len(forward)
        self.f_end = [[_UNKNOWN] * m for _ in range(p)]
        self.i_end = [[_UNKNOWN] * m for _ in range(p)]
        self.next_f, self.next_i, self.next_w = [0] * p, [0] * p, [0] * p
        self.clock = [0.0] * p
        self.last_was_i = [False] * p
        self.streams: list[list[Instruction]] = [[] for _ in range(p)]
        self.queue: list[tuple[float, int]] = [(0.0, r) for r in range(p)]
        self.blocked: dict[int, float] = {}  # rank -> time it waits from, for an unknown op

    def run(self) -> tuple[tuple[Instruction, ...], ...]:
        while self.queue:
            time, rank = heapq.heappop(self.queue)
            self._decide(rank, max(time, self.clock[rank]))
        if self.blocked:  # cannot happen with memory_limit >= 1; guard the invariant
            raise RuntimeError(f"greedy scheduler stuck on ranks {sorted(self.blocked)}")
        return tuple(tuple(stream) for stream in self.streams)

    def _f_arrival(self, r: int) -> float:
        """When the input of rank r's next F is there (_UNKNOWN if not yet scheduled)."""
        if r == 0:
            return 0.0
        end = self.f_end[r - 1][self.next_f[r]]
        return end + self.delay[r - 1] if end >= 0.0 else _UNKNOWN

    def _i_arrival(self, r: int) -> float:
        """When rank r's next I can start: its F done and the gradient from r+1 there."""
        k = self.next_i[r]
        own = self.f_end[r][k]
        if r == self.p - 1:
            return own
        grad = self.i_end[r + 1][k]
        return max(own, grad + self.delay[r]) if grad >= 0.0 else _UNKNOWN

    def _decide(self, r: int, t: float) -> None:
        m, knobs = self.m, self.knobs
        has_f = self.next_f[r] < m
        has_i = self.next_i[r] < self.next_f[r]  # an I whose F has run is still to come
        has_w = self.next_w[r] < self.next_i[r]
        memory_free = self.next_f[r] - self.next_w[r] < self.limit
        f_at = self._f_arrival(r) if has_f and memory_free else _UNKNOWN
        i_at = self._i_arrival(r) if has_i else _UNKNOWN
        can_f = 0.0 <= f_at <= t
        can_i = 0.0 <= i_at <= t
        if can_i and (knobs.input_grad_first or not self.last_was_i[r] or not can_f):
            return self._run(r, t, _I)
        if can_f and not (knobs.lookahead and t < i_at < t + self.forward[r]):
            return self._run(r, t, _F)
        known = [x for x in (f_at, i_at) if x > t]
        if has_w:
            # Step 2's W rules: free memory when it blocks an F; fill a long enough wait;
            # with nothing left to wait for, step 3 (all remaining W).
            if (has_f and not memory_free) or not (has_i or (has_f and memory_free)):
                return self._run(r, t, _W)
            if knobs.min_gap_for_w <= 0.0 or (
                    known and min(known) - t >= knobs.min_gap_for_w * self.weight[r]):
                return self._run(r, t, _W)
        if not (has_f or has_i or has_w):
            return  # the rank is done
        if known:
            heapq.heappush(self.queue, (min(known), r))
        else:
            self.blocked[r] = t  # woken when a neighbour schedules the op it waits for

    def _run(self, r: int, t: float, kind: Kind) -> None:
        if kind is _F:
            k = self.next_f[r]
            self.next_f[r] += 1
            end = self.f_end[r][k] = t + self.forward[r]
            neighbour = r + 1
        elif kind is _I:
            k = self.next_i[r]
            self.next_i[r] += 1
            end = self.i_end[r][k] = t + self.backward[r]
            neighbour = r - 1
        else:
            k = self.next_w[r]
            self.next_w[r] += 1
            end = t + self.weight[r]
            neighbour = NONE
        self.streams[r].append(instruction_from((kind, r, k, NONE)))
        self.last_was_i[r] = kind is _I
        self.clock[r] = end
        heapq.heappush(self.queue, (end, r))
        if neighbour in self.blocked:
            heapq.heappush(self.queue, (self.blocked.pop(neighbour), neighbour))
