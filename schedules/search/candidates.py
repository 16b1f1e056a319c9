"""Score candidate orders under real costs and keep the fastest: the cost-aware schedules' core."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from schedules.analysis.accounting import stream_peak
from schedules.analysis.dataflow import execute
from schedules.analysis.simulate import CostModel
from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule, check_count

__all__ = ["Candidate", "Orders", "ScheduleSearch", "check_memory_limit", "defer_weights",
           "peak_in_flight", "pick_fastest", "runs", "split_backward"]

Orders = list[tuple[str, tuple[tuple[Instruction, ...], ...]]]
"""(label, per-rank compute streams) candidates."""


@dataclass(frozen=True)
class Candidate:
    """One order `zb_auto` tried, and what it costs."""

    label: str
    cost: float
    """Longest rank span (first start to last end): the paper's iteration time, which
    `figures().bubble_rate` also uses. The search minimises it."""
    makespan: float
    peak: int
    """Most microbatches in flight (F started, W not run) on any rank."""


@dataclass(frozen=True)
class ScheduleSearch:
    """The chosen schedule and every candidate tried, best first."""

    schedule: Schedule
    candidates: tuple[Candidate, ...]


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
                 costs: CostModel, *,
                 objective: Literal["makespan", "span"] = "makespan") -> ScheduleSearch:
    """Simulate every candidate and keep the best under `objective`: "makespan" first (then
    the shorter longest rank span), or "span", the longest rank span first (then the shorter
    makespan: the zero-bubble paper's iteration time, for one-stage-per-rank orders); ties
    go to less memory, then to the earlier candidate."""
    m = num_microbatches
    forward, backward, weight, delay, _ = costs.resolve(len(placement))
    scored = []
    for index, (label, streams) in enumerate(orders):
        run = execute(streams, placement, m, forward, backward, weight, delay)
        if run.stuck:  # every candidate maker emits runnable orders; keep that visible
            raise ScheduleConfigError(f"{name} candidate {label} cannot run; this is a bug")
        span = max((ends[-1] - starts[0] for starts, ends in zip(run.starts, run.ends)
                    if ends), default=0.0)
        makespan = max((ends[-1] for ends in run.ends if ends), default=0.0)
        first, second = (makespan, span) if objective == "makespan" else (span, makespan)
        scored.append((first, second, peak_in_flight(streams), index, label, streams,
                       span, makespan))
    scored.sort(key=lambda row: row[:4])
    return ScheduleSearch(Schedule(name, m, placement, scored[0][5]),
                          tuple(Candidate(label, span, makespan, peak)
                                for _, _, peak, _, label, _, span, makespan in scored))


def peak_in_flight(streams: Sequence[Sequence[Instruction]]) -> int:
    """Most (stage, microbatch) activations any rank holds, read off the order alone: +1 at
    F, -1 at its last backward op (B, or W when split). Equals `figures().peak_activations`
    because a rank runs its ops one at a time."""
    return max((stream_peak(((op.kind, op.stage, op.microbatch) for op in stream),
                            [1.0] * (1 + max((op.stage for op in stream), default=0))).count
                for stream in streams), default=0)
