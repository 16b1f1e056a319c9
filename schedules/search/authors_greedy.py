"""The Zero Bubble authors' own greedy for one stage per rank (their scheduler's initial solution).

Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §3.2 and the public scheduler of
the paper (`manual_order` there). Rank j holds stage j. Microbatch by microbatch:
    - microbatch 0: every rank's first F; then, from the last rank up, as many extra F's as
      fit (in memory and) before the first I can arrive back, never more than the rank
      above; those F's, then every rank's first I from the last rank up;
    - microbatch i > 0: one more F on every rank that still has some, except (with
      `prioritize_i`) a rank two F's ahead of its successor when that F would delay the
      successor's F + I; then I of microbatch i from the last rank up;
    - before each F or I, W's fill the wait for its input while they fit, and one more W
      runs if the wait is longer than the bubble the most idle rank already has
      (`fill_bubbles_greedily`), or always when the wait exceeds it;
    - a W runs whenever memory blocks an F; the W's left run at the end.
Memory counts microbatches in flight: +1 at F, -1 at W (I frees none). The scheduler tries
the 2 × 2 × 2 knob settings; `zb_auto` takes them all as candidates and the benchmark
uses them as the reference heuristic. Written from the paper and its scheduler's steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from

__all__ = ["PaperGreedyKnobs", "paper_greedy_order"]

_F, _I, _W = Kind.F, Kind.I, Kind.W


class _Infeasible(Exception):
    """The steps cannot be laid out (memory too small for them): no candidate."""


@dataclass(frozen=True)
class PaperGreedyKnobs:
    """The three binary choices the authors' scheduler tries."""

    allow_bubble_before_first_i: bool = False
    prioritize_i: bool = False
    fill_bubbles_greedily: bool = True

    def label(self) -> str:
        return (f"paper-greedy(bubble_first_i={int(self.allow_bubble_before_first_i)}, "
                f"prioritize_i={int(self.prioritize_i)}, "
                f"greedy_fill={int(self.fill_bubbles_greedily)})")


def paper_greedy_order(num_microbatches: int, memory_limit: int, forward: Sequence[float],
                       backward: Sequence[float], weight: Sequence[float],
                       delay: Sequence[float], knobs: PaperGreedyKnobs) -> tuple[
        tuple[Instruction, ...], ...] | None:
    """Per-rank streams for p = len(forward) stages, or None when memory_limit (microbatches
    in flight per rank) is too small for the steps. `delay[j]`: the j <-> j+1 comm delay."""
    state = _State(num_microbatches, memory_limit, forward, backward, weight, delay, knobs)
    try:
        state.run()
    except _Infeasible:
        return None
    return tuple(tuple(stream) for stream in state.streams)


class _State:
    # Legend: p ranks = stages, m microbatches; f/b/w count F, I, W put per rank (each in
    # microbatch order); clock[j] is rank j's time; end[(kind, j, i)] the end of an op.

    def __init__(self, m: int, limit: int, forward: Sequence[float], backward: Sequence[float],
                 weight: Sequence[float], delay: Sequence[float],
                 knobs: PaperGreedyKnobs) -> None:
        self.m, self.limit, self.knobs = m, limit, knobs
        self.cost = {_F: forward, _I: backward, _W: weight}
        self.delay = delay
        p = self.p = len(forward)
        self.count = {_F: [0] * p, _I: [0] * p, _W: [0] * p}
        self.clock = [0.0] * p
        self.memory = [0] * p
        self.bubble = [0.0] * p
        self.end: dict[tuple[Kind, int, int], float] = {}
        self.streams: list[list[Instruction]] = [[] for _ in range(p)]

    def put(self, j: int, kind: Kind) -> None:
        i = self.count[kind][j]
        if i >= self.m or (kind is _I and self.count[_F][j] <= i) or (
                kind is _W and self.count[_I][j] <= i) or (
                kind is _F and self.memory[j] + 1 > self.limit):
            raise _Infeasible
        start = self.clock[j]
        if kind is _F and j > 0:
            start = max(start, self.arrival(_F, j - 1, i, self.delay[j - 1]))
        if kind is _I and j < self.p - 1:
            start = max(start, self.arrival(_I, j + 1, i, self.delay[j]))
        if self.count[_F][j] > 0:
            self.bubble[j] += start - self.clock[j]
        self.clock[j] = self.end[kind, j, i] = start + self.cost[kind][j]
        self.memory[j] += 1 if kind is _F else -1 if kind is _W else 0
        self.count[kind][j] += 1
        self.streams[j].append(instruction_from((kind, j, i, NONE)))

    def arrival(self, kind: Kind, j: int, i: int, delay: float) -> float:
        end = self.end.get((kind, j, i))
        if end is None:
            raise _Infeasible  # the input is not laid out yet
        return end + delay

    def fill_wait(self, j: int, arrival: float) -> None:
        """W's that end before `arrival`; then one more per the knob and the bubble."""
        count, cost = self.count, self.cost[_W][j]
        while count[_W][j] < count[_I][j] and self.clock[j] + cost <= arrival:
            self.put(j, _W)
        if count[_W][j] < count[_I][j] and self.clock[j] < arrival:
            small = arrival - self.clock[j] <= max(self.bubble) - self.bubble[j]
            if self.knobs.fill_bubbles_greedily or not small:
                self.put(j, _W)

    def free_memory(self, j: int) -> None:
        while self.memory[j] + 1 > self.limit:
            if self.count[_W][j] >= self.count[_I][j]:
                raise _Infeasible
            self.put(j, _W)

    def run(self) -> None:
        p, m = self.p, self.m
        for i in range(m):
            if i == 0:
                self._first_microbatch()
                continue
            wanted = self._forward_wanted()
            for j in range(p):
                if wanted[j]:
                    self.free_memory(j)
                    if j > 0:
                        self.fill_wait(j, self.arrival(_F, j - 1, self.count[_F][j],
                                                       self.delay[j - 1]))
                    self.put(j, _F)
            for j in range(p - 1, -1, -1):
                if j + 1 < p:
                    self.fill_wait(j, self.arrival(_I, j + 1, i, self.delay[j]))
                if j == 0 and self.count[_F][j] == m:
                    while self.count[_W][j] < self.count[_I][j]:
                        self.put(j, _W)
                self.put(j, _I)
        for j in range(p):
            while self.count[_W][j] < m:
                self.put(j, _W)

    def _first_microbatch(self) -> None:
        p, m, cost, delay = self.p, self.m, self.cost, self.delay
        for j in range(p):
            self.put(j, _F)
        extra = [0] * p
        back = 0.0  # when microbatch 0's input gradient reaches the rank below
        for j in range(p - 1, -1, -1):
            if j == p - 1:
                back = self.end[_F, j, 0] + cost[_I][j]
                continue
            memory, time = self.memory[j], self.clock[j]
            while self.count[_F][j] + extra[j] < m and memory + 1 <= self.limit:
                if self.knobs.allow_bubble_before_first_i:
                    if time + cost[_F][j] > back + delay[j]:
                        break
                elif time >= back + delay[j]:
                    break
                memory += 1
                time += cost[_F][j]
                extra[j] += 1
            back = max(time, back + delay[j]) + cost[_I][j]
        for j in range(1, p):  # never more extra F's than the rank above
            while extra[j] > 0 and extra[j] >= extra[j - 1] and self.count[_F][j] + extra[j] < m:
                extra[j] -= 1
        for j in range(p):
            for _ in range(extra[j]):
                self.put(j, _F)
        for j in range(p - 1, -1, -1):
            self.put(j, _I)

    def _forward_wanted(self) -> list[bool]:
        p, cost, delay = self.p, self.cost, self.delay
        count, clock = self.count, self.clock
        wanted = [False] * p
        for j in range(p):
            if count[_F][j] >= self.m:
                continue
            if self.knobs.prioritize_i and j + 1 < p and count[_F][j] >= count[_F][j + 1] + 2:
                # The successor's next F and I: do not delay them with an F here.
                successor = clock[j + 1] + cost[_F][j + 1] + cost[_I][j + 1] + delay[j]
                if clock[j] >= successor:
                    continue
                w_needed = max(0, self.memory[j] + 1 - self.limit)
                if count[_W][j] + w_needed <= count[_I][j] and \
                        clock[j] + cost[_F][j] + w_needed * cost[_W][j] <= successor:
                    wanted[j] = True
                    continue
                if successor - clock[j] <= max(self.bubble) - self.bubble[j]:
                    continue
            wanted[j] = True
        for j in range(p - 2, -1, -1):  # a rank runs an F only if the rank below does
            wanted[j] = wanted[j] and wanted[j + 1]
        return wanted
