"""A cost-aware list scheduler for split backwards on any placement, under a memory limit.

The Zero Bubble paper's greedy (`schedules.search.paper_greedy`) decides, rank by rank against
simulated time, whether to run an F, an I (the paper's B) or a W next. This is the same
idea for ranks that hold several stages (v chunks, in a loop or a V), which is what
ZB-V under real costs, interleaved zero bubble and memory-capped V schedules need:
    - a ready I runs first (it is on the critical path back to stage 0), unless the knobs
      say F first;
    - else a ready F, if memory allows;
    - else a W fills the wait, or frees memory when the limit blocks an F;
    - else the rank waits for the earliest arrival it knows of.
Memory: a rank admits microbatch i (the F of its lowest stage) only if every microbatch
it has admitted can still take all of its stages there: v·(admitted + 1) - W done <= K.
Forwards of its other stages then never wait for memory, so the oldest microbatch can
always finish its backward and free a W: the order never deadlocks when K >= v.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from schedules.ir.instructions import NONE, Instruction, Kind, instruction_from

__all__ = ["CRITICAL_PATH_GRID", "LARGE_PROBLEM", "LIST_KNOB_GRID", "SMALL_KNOB_GRID",
           "ListKnobs", "knob_grid", "list_order", "try_list_order"]

_F, _I, _W = Kind.F, Kind.I, Kind.W
_UNKNOWN = -1.0  # end time of an op not scheduled yet


@dataclass(frozen=True, kw_only=True)
class ListKnobs:
    """The choices a cost-aware search tries (see `KNOB_GRID` users)."""

    backward_first: bool = True
    """When an I and an F are both ready, run the I (True) or the F."""
    deepest_forward: bool = True
    """Among ready F, the highest stage first (depth first: microbatches finish sooner and
    free memory) or the lowest (breadth first: more work enters the pipeline)."""
    deepest_backward: bool = False
    """Among ready I, the highest stage first, or the lowest (closer to stage 0)."""
    min_gap_for_w: float = 0.0
    """Fill a wait with W only if it lasts at least this many W times (0: any wait)."""
    lookahead: bool = False
    """Do not start an F when an I arrives before that F could end."""
    critical_path: bool = False
    """Among all ready F and I, run the one with the longest path of true costs to the
    end of the step (then the older microbatch, then the I); the three knobs above that
    order F and I are then unused."""
    reserve: bool = True
    """Admit a microbatch only when all its stages on the rank fit in memory (True: never
    deadlocks), or start any F that fits (False: holds more at once; an order that would
    deadlock is dropped, see `list_order`)."""

    def label(self) -> str:
        if self.critical_path:
            return (f"list(critical_path, w_gap={self.min_gap_for_w:g}, "
                    f"lookahead={int(self.lookahead)}, reserve={int(self.reserve)})")
        return (f"list(i_first={int(self.backward_first)}, "
                f"deep_f={int(self.deepest_forward)}, deep_i={int(self.deepest_backward)}, "
                f"w_gap={self.min_gap_for_w:g}, lookahead={int(self.lookahead)})")


LIST_KNOB_GRID: tuple[ListKnobs, ...] = tuple(
    ListKnobs(backward_first=first, deepest_forward=deep_f, deepest_backward=deep_i,
              min_gap_for_w=gap, lookahead=look)
    for first, deep_f, deep_i, gap, look in itertools.product(
        (True, False), (True, False), (True, False), (0.0, 1.0), (False, True)))
"""The variants every cost-aware schedule tries (32; with one stage per rank the two
`deepest_*` knobs change nothing, so `zb_auto` takes the 8 with both True)."""

SMALL_KNOB_GRID: tuple[ListKnobs, ...] = tuple(
    knobs for knobs in LIST_KNOB_GRID if knobs.deepest_forward and not knobs.lookahead)
"""The 8 variants tried on large problems (more than `LARGE_PROBLEM` ops), where each run
of the list scheduler costs seconds."""

LARGE_PROBLEM = 5_000

CRITICAL_PATH_GRID: tuple[ListKnobs, ...] = tuple(
    ListKnobs(critical_path=True, min_gap_for_w=gap, lookahead=look, reserve=reserve)
    for gap, look, reserve in itertools.product((0.0, 1.0), (False, True), (True, False)))
"""The critical-path variants (8) that `zb_v_auto` tries besides `knob_grid`'s (the first
2, w_gap 0 without lookahead, on large problems)."""


def knob_grid(num_stages: int, num_microbatches: int) -> tuple[ListKnobs, ...]:
    """`LIST_KNOB_GRID`, or `SMALL_KNOB_GRID` above `LARGE_PROBLEM` compute ops."""
    return SMALL_KNOB_GRID if 3 * num_stages * num_microbatches > LARGE_PROBLEM else \
        LIST_KNOB_GRID


def list_order(placement: Sequence[int], num_microbatches: int, memory_limit: int,
               forward: Sequence[float], backward: Sequence[float], weight: Sequence[float],
               delay: Sequence[float], knobs: ListKnobs = ListKnobs()) -> tuple[
        tuple[Instruction, ...], ...]:
    """Per-rank compute streams (F, I, W) for stage s on rank placement[s].

    `delay[s]` is the comm delay on the s <-> s+1 edge when the two stages are on different
    ranks. No rank holds more than `memory_limit` (stage, microbatch) activations (F
    started, W not run); the caller checks memory_limit >= the most stages on one rank.
    """
    streams = _ListScheduler(placement, num_microbatches, memory_limit, forward, backward,
                             weight, delay, knobs).run()
    if streams is None:  # cannot happen when knobs.reserve; keep it visible
        raise RuntimeError(f"list scheduler stuck with {knobs.label()}")
    return streams


def try_list_order(placement: Sequence[int], num_microbatches: int, memory_limit: int,
                   forward: Sequence[float], backward: Sequence[float],
                   weight: Sequence[float], delay: Sequence[float],
                   knobs: ListKnobs) -> tuple[tuple[Instruction, ...], ...] | None:
    """`list_order`, or None when the order cannot finish (only without `knobs.reserve`:
    every rank's memory full of forwards whose backwards wait on another full rank)."""
    return _ListScheduler(placement, num_microbatches, memory_limit, forward, backward,
                          weight, delay, knobs).run()


class _ListScheduler:
    # Legend: S stages, stage s on rank placement[s]; m microbatches; per stage, F and I
    # run in microbatch order; per rank, W in the order of its I's. f_end / i_end hold end
    # times (_UNKNOWN until scheduled). "admitted" counts F's of a rank's lowest stage.

    def __init__(self, placement: Sequence[int], m: int, limit: int, forward: Sequence[float],
                 backward: Sequence[float], weight: Sequence[float], delay: Sequence[float],
                 knobs: ListKnobs) -> None:
        self.placement, self.m, self.limit, self.knobs = placement, m, limit, knobs
        self.forward, self.backward, self.weight, self.delay = forward, backward, weight, delay
        num_stages = len(placement)
        p = self.p = 1 + max(placement)
        stages_of: list[list[int]] = [[] for _ in range(p)]
        for s, r in enumerate(placement):
            stages_of[r].append(s)
        self.forward_order = [sorted(ss, reverse=knobs.deepest_forward) for ss in stages_of]
        self.backward_order = [sorted(ss, reverse=knobs.deepest_backward) for ss in stages_of]
        self.first_stage = [min(ss) for ss in stages_of]
        self.chunks = [len(ss) for ss in stages_of]
        self.f_end = [[_UNKNOWN] * m for _ in range(num_stages)]
        self.i_end = [[_UNKNOWN] * m for _ in range(num_stages)]
        self.next_f, self.next_i = [0] * num_stages, [0] * num_stages
        self.w_done, self.ops_left = [0] * p, [3 * m * len(ss) for ss in stages_of]
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        self.clock = [0.0] * p
        self.streams: list[list[Instruction]] = [[] for _ in range(p)]
        self.queue: list[tuple[float, int]] = [(0.0, r) for r in range(p)]
        self.blocked: dict[int, float] = {}  # rank -> time it waits from, for an unknown op
        self.held = [0] * p  # activations a rank holds: F started, W not run
        self.f_tail, self.i_tail = _tails(placement, forward, backward, weight, delay)

    def run(self) -> tuple[tuple[Instruction, ...], ...] | None:
        while self.queue:
            time, rank = heapq.heappop(self.queue)
            self._decide(rank, max(time, self.clock[rank]))
        if any(self.ops_left):
            return None
        return tuple(tuple(stream) for stream in self.streams)

    def _f_arrival(self, r: int, s: int) -> float:
        """When F(s, next) can start on rank r, memory aside (_UNKNOWN if not yet known)."""
        i = self.next_f[s]
        if i >= self.m:
            return _UNKNOWN
        if s == 0:
            return 0.0
        end = self.f_end[s - 1][i]
        if end < 0.0:
            return _UNKNOWN
        return end + (self.delay[s - 1] if self.placement[s - 1] != r else 0.0)

    def _i_arrival(self, r: int, s: int) -> float:
        """When I(s, next) can start: its F done and the gradient from s+1 there."""
        i = self.next_i[s]
        if i >= self.next_f[s]:
            return _UNKNOWN
        own = self.f_end[s][i]
        if s == len(self.placement) - 1:
            return own
        grad = self.i_end[s + 1][i]
        if grad < 0.0:
            return _UNKNOWN
        return max(own, grad + (self.delay[s] if self.placement[s + 1] != r else 0.0))

    def _memory_allows(self, r: int, s: int) -> bool:
        if not self.knobs.reserve:
            return self.held[r] < self.limit
        if s != self.first_stage[r]:
            return True  # reserved when the microbatch was admitted
        admitted = self.next_f[s]
        return self.chunks[r] * (admitted + 1) - self.w_done[r] <= self.limit

    def _decide(self, r: int, t: float) -> None:
        self.blocked.pop(r, None)
        if not self.ops_left[r]:
            return
        knobs = self.knobs
        i_at = [(s, self._i_arrival(r, s)) for s in self.backward_order[r]]
        ready_i = next((s for s, at in i_at if 0.0 <= at <= t), None)
        i_times = [at for _, at in i_at if at > t]
        ready_f = None
        memory_blocked = False
        known: list[float] = []
        for s in self.forward_order[r]:
            at = self._f_arrival(r, s)
            if at < 0.0:
                continue
            if not self._memory_allows(r, s):
                memory_blocked = True
                continue
            if at <= t:
                ready_f = s if ready_f is None else ready_f
            else:
                known.append(at)
        known.extend(i_times)
        if knobs.critical_path:
            ready_i, ready_f = self._most_critical(r, t, i_at, ready_f is not None)
        if ready_i is not None and (knobs.backward_first or ready_f is None):
            return self._run(r, t, _I, ready_i)
        if ready_f is not None and not (
                knobs.lookahead and any(at < t + self.forward[ready_f] for at in i_times)):
            return self._run(r, t, _F, ready_f)
        if self.pending_w[r]:
            stage = self.pending_w[r][0][0]
            only_w_left = self.ops_left[r] == len(self.pending_w[r])
            long_wait = knobs.min_gap_for_w <= 0.0 or (
                known and min(known) - t >= knobs.min_gap_for_w * self.weight[stage])
            if memory_blocked or only_w_left or long_wait:
                return self._run(r, t, _W, stage)
        # Wait for the earliest known arrival, and let a neighbour wake the rank sooner if
        # it schedules an op that arrives before then.
        if known:
            heapq.heappush(self.queue, (min(known), r))
        self.blocked[r] = t

    def _most_critical(self, r: int, t: float, i_at: list[tuple[int, float]],
                       any_f: bool) -> tuple[int | None, int | None]:
        """The ready I or F (the other None) with the longest tail, then the older
        microbatch, then the I."""
        best: tuple[float, int, int, int] | None = None
        for s, at in i_at:
            if 0.0 <= at <= t:
                best = max(best or (-1.0, 0, 0, 0), (self.i_tail[s], -self.next_i[s], 1, s))
        if any_f:
            for s in self.forward_order[r]:
                at = self._f_arrival(r, s)
                if 0.0 <= at <= t and self._memory_allows(r, s):
                    best = max(best or (-1.0, 0, 0, 0), (self.f_tail[s], -self.next_f[s], 0, s))
        if best is None:
            return None, None
        return (best[3], None) if best[2] else (None, best[3])

    def _run(self, r: int, t: float, kind: Kind, s: int) -> None:
        if kind is _F:
            self.held[r] += 1
            i = self.next_f[s]
            self.next_f[s] += 1
            end = self.f_end[s][i] = t + self.forward[s]
            neighbour = s + 1
        elif kind is _I:
            i = self.next_i[s]
            self.next_i[s] += 1
            end = self.i_end[s][i] = t + self.backward[s]
            self.pending_w[r].append((s, i))
            neighbour = s - 1
        else:
            s, i = self.pending_w[r].popleft()
            self.w_done[r] += 1
            self.held[r] -= 1
            end = t + self.weight[s]
            neighbour = -1
        self.ops_left[r] -= 1
        self.streams[r].append(instruction_from((kind, s, i, NONE)))
        self.clock[r] = end
        heapq.heappush(self.queue, (end, r))
        if 0 <= neighbour < len(self.placement):
            other = self.placement[neighbour]
            if other != r and other in self.blocked:
                heapq.heappush(self.queue, (self.blocked.pop(other), other))


def _tails(placement: Sequence[int], forward: Sequence[float], backward: Sequence[float],
           weight: Sequence[float], delay: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per stage, the longest chain of true costs (and cross-rank delays) from the start of
    an F, and of an I, to the end of its microbatch's last op: the list scheduler's
    critical-path priorities."""
    last = len(placement) - 1
    hop = [delay[s] if s < last and placement[s] != placement[s + 1] else 0.0
           for s in range(last + 1)]
    i_tail = [0.0] * (last + 1)
    for s in range(last + 1):
        i_tail[s] = backward[s] + max(weight[s], i_tail[s - 1] + hop[s - 1] if s else 0.0)
    f_tail = [0.0] * (last + 1)
    for s in range(last, -1, -1):
        f_tail[s] = forward[s] + max(i_tail[s], f_tail[s + 1] + hop[s] if s < last else 0.0)
    return f_tail, i_tail
