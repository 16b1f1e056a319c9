"""Run compute streams against their data dependencies: the one core under lowering and simulation.

Semantics (the simulator's and the lowering's): each rank runs its stream strictly in order;
an op starts at max(rank free, end of each dependency + delay if the dependency ran on
another rank). Dependencies of stage s, microbatch i (S stages):
    F(s,i)      <- F(s-1,i)                  (none for s = 0)
    B|I(s,i)    <- F(s,i), B|I(s+1,i)        (the latter absent for s = S-1)
    W(s,i)      <- I(s,i)
An F followed on its rank by an OVERLAP_B (DualPipe's overlapped F&B pair) starts when the
inputs of both are there and lasts `overlap` × (F + B), or what `pair` says (an expert
all-to-all interleaved, `schedules.analysis.all_to_all`); both outputs leave at its end.
Written as an event loop (a rank runs until it blocks, then waits on the op it needs)
rather than with networkx because it must execute ~1M ops a second for the planner.

Given `limit`, a run stops as soon as a rank is proven to end past its limit: a rank's end
is its compute work (the costs of its ops) plus the time it waits, so once the waits seen
so far plus all its work pass the limit, it ends past it whatever follows (the planner
drops a configuration another one beats before finishing its simulation).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import NamedTuple

from schedules.ir.instructions import Instruction, Kind

__all__ = ["Execution", "execute", "op_counts"]


class Execution(NamedTuple):
    """Start and end time of every op, per rank in stream order; `stuck` maps a rank that
    could not finish to the index of the op it waits on forever (empty when all finished)."""

    starts: list[list[float]]
    ends: list[list[float]]
    stuck: dict[int, int]
    waited: list[float] | None = None
    """Per rank, the time its forwards waited for their `release` (None without one)."""
    over: int | None = None
    """The rank proven to end past its `limit`; the run stopped there, its ops partly
    executed (None: a whole run)."""


_ROUNDING = 4 * 2.0**-53
"""Per op, a bound on the relative rounding of summed float times: a rank's clock is a sum
of n costs and waits and its work another, each within n·2^-53 of the exact sum; `execute`
stops only past limit · (1 + _ROUNDING · (n + 8)), so a stopped rank's computed end is past
its limit too."""


def execute(
    streams: Sequence[Sequence[Instruction]],
    placement: Sequence[int],
    num_microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float],
    delay: Sequence[float],
    overlap: float = 1.0,
    release: dict[int, float] | None = None,
    pair: Callable[[int, int], tuple[float, float]] | None = None,
    limit: Sequence[float] | None = None,
    counts: Sequence[Mapping[tuple[Kind, int], int]] | None = None,
) -> Execution:
    """Execute compute-only `streams`; per-stage costs, `delay[s]` on the s ↔ s+1 edge.

    A fused B costs backward[s] + weight[s]; I costs backward[s]; W costs weight[s]; a pair
    F(s) + OVERLAP_B(s') costs overlap × (forward[s] + backward[s'] + weight[s']), shown as
    two spans in that proportion; given `pair`, `pair(s, s')` is the pair's (F span, B span).
    `release` maps an F's key s·m + i to a time it cannot start before (the parameters a
    gather still brings, `schedules.analysis.gather`); the time an F waits past its other
    inputs adds to its rank's `waited`.
    Ops must reference stages in range(len(placement)) and microbatches in range(m);
    the validator checks that before calling this. Any other kind (LOAD, SEND/RECV,
    REDUCE_GRAD, STEP) is read as what it is here: no work, a zero-length span at the
    rank's clock (never as a backward of the stage or microbatch -1 it carries).
    `limit[rank]`: stop once that rank is proven to end past it (`Execution.over`); a rank
    whose end is at or under its limit never stops the run. `counts`: `op_counts(streams)`
    where the caller keeps them (counted here otherwise).
    """
    kind_f, kind_b, kind_w, kind_i, kind_ob = Kind.F, Kind.B, Kind.W, Kind.I, Kind.OVERLAP_B
    num_ranks = len(streams)
    m = num_microbatches
    num_stages = len(placement)
    grad_base = num_stages * m  # keys >= grad_base name B|I(s,i); below, F(s,i)
    f_end = [-1.0] * grad_base
    g_end = [-1.0] * grad_base
    fused = [b + w for b, w in zip(backward, weight)]
    positions = [0] * num_ranks
    clocks = [0.0] * num_ranks
    starts: list[list[float]] = [[] for _ in range(num_ranks)]
    ends: list[list[float]] = [[] for _ in range(num_ranks)]
    # the ranks blocked on each op's end, by key (a list: read on every op, cheaper than
    # a dict); the last slot, never waited on, is where a W (which nothing waits on) ends
    waiting: list[list[int] | None] = [None] * (2 * grad_base + 1)
    no_waiter = 2 * grad_base

    def wait_for(key: int, rank: int) -> None:
        ranks = waiting[key]
        if ranks is None:
            waiting[key] = [rank]
        else:
            ranks.append(rank)
    waited = [0.0] * num_ranks
    # a rank stops the run once its waits pass its room: limit - work, within rounding
    rooms = [float("inf")] * num_ranks if limit is None else \
        _rooms(counts or op_counts(streams), limit, forward, backward, weight, fused,
               sum(map(len, streams)))
    idles = [0.0] * num_ranks
    pairs = [kind_ob in map(_KIND, stream) for stream in streams]  # scanned in C
    over = next((rank for rank, room in enumerate(rooms) if room < 0.0), None)
    runnable = [] if over is not None else list(range(num_ranks - 1, -1, -1))
    while runnable:
        rank = runnable.pop()
        stream = streams[rank]
        k, clock, n = positions[rank], clocks[rank], len(stream)
        rank_starts, rank_ends = starts[rank], ends[rank]
        idle, room, paired = idles[rank], rooms[rank], pairs[rank]
        while k < n:
            kind, s, i, _ = stream[k]
            index = s * m + i
            ready = clock
            if kind is kind_f and paired and k + 1 < n and stream[k + 1][0] is kind_ob:
                # The overlapped pair: wait for the inputs of both, then run as one op.
                if s:
                    dep = f_end[index - m]
                    if dep < 0.0:
                        wait_for(index - m, rank)
                        break
                    if placement[s - 1] != rank:
                        dep += delay[s - 1]
                    if dep > ready:
                        ready = dep
                s2 = stream[k + 1][1]
                index2 = s2 * m + stream[k + 1][2]
                dep = f_end[index2]
                if dep < 0.0:
                    wait_for(index2, rank)
                    break
                if dep > ready:
                    ready = dep
                if s2 + 1 < num_stages:
                    dep = g_end[index2 + m]
                    if dep < 0.0:
                        wait_for(grad_base + index2 + m, rank)
                        break
                    if placement[s2 + 1] != rank:
                        dep += delay[s2]
                    if dep > ready:
                        ready = dep
                if release is not None and release.get(index, ready) > ready:
                    waited[rank] += release[index] - ready
                    ready = release[index]
                if pair is None:
                    split = ready + overlap * forward[s]
                    end = split + overlap * fused[s2]
                else:
                    forward_part, backward_part = pair(s, s2)
                    split = ready + forward_part
                    end = split + backward_part
                f_end[index] = end
                g_end[index2] = end
                rank_starts.append(ready)
                rank_ends.append(split)
                rank_starts.append(split)
                rank_ends.append(end)
                idle += end - clock  # the pair's wait and time: not in the rank's work
                clock = end
                k += 2
                if idle > room:
                    over = rank
                    break
                for key in (index, grad_base + index2):
                    ranks = waiting[key]
                    if ranks is not None:
                        runnable.extend(ranks)
                        waiting[key] = None
                continue
            if kind is kind_f:
                if s:
                    dep = f_end[index - m]
                    if dep < 0.0:
                        wait_for(index - m, rank)
                        break
                    if placement[s - 1] != rank:
                        dep += delay[s - 1]
                    if dep > ready:
                        idle += dep - ready
                        ready = dep
                        if idle > room:  # tested on waits only, where idle grows
                            over = rank
                            break
                if release is not None and release.get(index, ready) > ready:
                    waited[rank] += release[index] - ready
                    idle += release[index] - ready
                    ready = release[index]
                    if idle > room:
                        over = rank
                        break
                end = ready + forward[s]
                f_end[index] = end
                done_key = index
            elif kind is kind_w:
                dep = g_end[index]
                if dep < 0.0:
                    wait_for(grad_base + index, rank)
                    break
                if dep > ready:
                    idle += dep - ready
                    ready = dep
                    if idle > room:
                        over = rank
                        break
                end = ready + weight[s]
                done_key = no_waiter
            elif kind is kind_b or kind is kind_i or kind is kind_ob:  # a lone OVERLAP_B is a B
                dep = f_end[index]
                if dep < 0.0:
                    wait_for(index, rank)
                    break
                if dep > ready:
                    idle += dep - ready
                    ready = dep
                    if idle > room:
                        over = rank
                        break
                if s + 1 < num_stages:
                    dep = g_end[index + m]
                    if dep < 0.0:
                        wait_for(grad_base + index + m, rank)
                        break
                    if placement[s + 1] != rank:
                        dep += delay[s]
                    if dep > ready:
                        idle += dep - ready
                        ready = dep
                        if idle > room:  # tested on waits only, where idle grows
                            over = rank
                            break
                end = ready + (backward[s] if kind is kind_i else fused[s])
                g_end[index] = end
                done_key = grad_base + index
            else:  # LOAD, SEND/RECV, REDUCE_GRAD, STEP: no compute, no dependency, no time
                rank_starts.append(clock)
                rank_ends.append(clock)
                k += 1
                continue
            rank_starts.append(ready)
            rank_ends.append(end)
            clock = end
            k += 1
            ranks = waiting[done_key]
            if ranks is not None:
                runnable.extend(ranks)
                waiting[done_key] = None
        positions[rank], clocks[rank], idles[rank] = k, clock, idle
        if over is not None:
            return Execution(starts, ends, {}, None if release is None else waited, over)
    stuck = {r: positions[r] for r in range(num_ranks) if positions[r] < len(streams[r])}
    return Execution(starts, ends, stuck, None if release is None else waited, over)


def op_counts(streams: Sequence[Sequence[Instruction]]) -> list[Counter[tuple[Kind, int]]]:
    """Per rank, its ops counted by (kind, stage): what a limited run's bound reads."""
    return [Counter(map(_KIND_AND_STAGE, stream)) for stream in streams]  # in C: no per-op Python


def _rooms(counts: Sequence[Mapping[tuple[Kind, int], int]], limit: Sequence[float],
           forward: Sequence[float], backward: Sequence[float], weight: Sequence[float],
           fused: Sequence[float], ops: int) -> list[float]:
    """Per rank, the waits it may take and still end by its limit: the limit, less rounding,
    less the costs of all its ops. On a rank with overlapped pairs its F and OVERLAP_B ops
    count nothing here (a pair's time is not the sum of its ops'): `execute` counts each
    pair's time with the waits instead."""
    rooms = []
    slack = _ROUNDING * (ops + 8)
    for rank, rank_counts in enumerate(counts):
        paired = any(kind is Kind.OVERLAP_B for kind, _ in rank_counts)
        work = 0.0
        for (kind, s), count in rank_counts.items():
            if kind is Kind.F and not paired:
                work += count * forward[s]
            elif kind is Kind.B:
                work += count * fused[s]
            elif kind is Kind.I:
                work += count * backward[s]
            elif kind is Kind.W:
                work += count * weight[s]
        rooms.append(limit[rank] * (1.0 + slack) - work)
    return rooms


_KIND = itemgetter(0)
_KIND_AND_STAGE = itemgetter(0, 1)
