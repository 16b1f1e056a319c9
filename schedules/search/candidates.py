"""Score candidate orders under real costs and keep the fastest: the cost-aware schedules' core."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from schedules.analysis.dataflow import execute
from schedules.analysis.simulate import CostModel
from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule, check_count
from schedules.search.zb_auto import Candidate, ScheduleSearch, peak_in_flight

__all__ = ["Orders", "check_memory_limit", "defer_weights", "pick_fastest", "runs",
           "split_backward"]

Orders = list[tuple[str, tuple[tuple[Instruction, ...], ...]]]
"""(label, per-rank compute streams) candidates."""


def check_memory_limit(memory_limit: int | None, *, default: int, minimum: int,
                       what: str) -> int:
    """`memory_limit` (default `default`) if it is an int >= `minimum`, else a one-line
    `ScheduleConfigError` naming the minimum and why."""
    if memory_limit is None:
        return default
    return check_count("memory_limit", memory_limit, minimum=minimum,
                       hint=f" ((stage, microbatch) activations a rank may hold; {what})")


def split_backward(streams: Sequence[Sequence[Instruction]]) -> tuple[
        tuple[Instruction, ...], ...]:
    """Each fused B as I then W at once: the same order and memory, runnable as a split one."""
    return tuple(tuple(x for op in stream for x in (
        (Instruction(Kind.I, op.stage, op.microbatch), Instruction(Kind.W, op.stage,
                                                                    op.microbatch))
        if op.kind is Kind.B else (op,))) for stream in streams)


def defer_weights(streams: Sequence[Sequence[Instruction]], lags: Sequence[int]) -> tuple[
        tuple[Instruction, ...], ...]:
    """Hold back each rank's W's: on rank r, a W runs only once `lags[r]` later W's are
    queued (the rest at the end), ZB-H1's device for filling the cool-down with W's."""
    out = []
    for stream, lag in zip(streams, lags):
        held: deque[Instruction] = deque()
        kept: list[Instruction] = []
        for op in stream:
            if op.kind is Kind.W:
                held.append(op)
                if len(held) > lag:
                    kept.append(held.popleft())
            else:
                kept.append(op)
        kept.extend(held)
        out.append(tuple(kept))
    return tuple(out)


def runs(streams: Sequence[Sequence[Instruction]], placement: Sequence[int], m: int) -> bool:
    """True if the compute order can run to the end (no rank waits forever)."""
    ones = [1.0] * len(placement)
    return not execute(streams, placement, m, ones, ones, ones, ones).stuck


def pick_fastest(name: str, num_microbatches: int, placement: tuple[int, ...], orders: Orders,
                 costs: CostModel) -> ScheduleSearch:
    """Simulate every candidate and keep the shortest makespan (then the shorter longest
    rank span, then less memory, then the earlier candidate)."""
    m = num_microbatches
    forward, backward, weight, delay, _ = costs.resolve(len(placement))
    scored = []
    for index, (label, streams) in enumerate(orders):
        run = execute(streams, placement, m, forward, backward, weight, delay)
        if run.stuck:  # every candidate maker emits runnable orders; keep that visible
            raise ScheduleConfigError(f"{name} candidate {label} cannot run; this is a bug")
        cost = max((ends[-1] - starts[0] for starts, ends in zip(run.starts, run.ends)
                    if ends), default=0.0)
        makespan = max((ends[-1] for ends in run.ends if ends), default=0.0)
        scored.append((makespan, cost, peak_in_flight(streams), index, label, streams))
    scored.sort(key=lambda row: row[:4])
    return ScheduleSearch(Schedule(name, m, placement, scored[0][5]),
                          tuple(Candidate(label, cost, makespan, peak)
                                for makespan, cost, peak, _, label, _ in scored))
