"""Compute runs kept across simulations that share a schedule and its compute costs."""

from __future__ import annotations

import weakref
from collections import Counter, OrderedDict
from typing import Any

from schedules.analysis.dataflow import Execution, op_counts
from schedules.analysis.timeline import Timeline
from schedules.ir.instructions import Kind
from schedules.ir.schedule import Schedule

__all__ = ["ComputeRuns"]

_KEPT_COUNTS = 16


class ComputeRuns:
    """The compute part of `simulate` (the executed streams and their timeline), kept for
    simulations of the same schedule object on the same compute costs that differ only in
    what is laid on the communication lane afterwards (the gradient reduction, an exposed
    parameter gather): a planner's configurations that differ only in their ZeRO stage.

    The key holds every input of the compute run (`simulate` builds it), so a kept run is
    the run that would be made: nothing is approximated. Each entry holds its schedule, so
    the schedule's id in the key cannot be reused by another object while the entry lives.
    Least recently used runs are dropped beyond `max_ops` executed ops in all (~100 bytes
    each kept). It also keeps each schedule's op counts, which a limited run's bound reads
    (`op_counts`)."""

    def __init__(self, max_ops: int = 600_000) -> None:
        if max_ops < 0:
            raise ValueError(f"max_ops must be >= 0, got {max_ops!r}")
        self.max_ops = max_ops
        self.hits = 0
        self._ops = 0
        self._entries: OrderedDict[tuple[Any, ...],
                                   tuple[Schedule, Timeline, Execution, int]] = OrderedDict()
        self._counts: OrderedDict[int, tuple[weakref.ref[Schedule],
                                             list[Counter[tuple[Kind, int]]]]] = OrderedDict()

    def op_counts(self, schedule: Schedule) -> list[Counter[tuple[Kind, int]]]:
        """`dataflow.op_counts` of the schedule's compute streams, counted once per schedule
        (the last `_KEPT_COUNTS` schedules asked for). An entry holds a weak reference to its
        schedule: it keeps no schedule alive, and one whose id is reused is not taken for
        it."""
        entry = self._counts.get(id(schedule))
        if entry is None or entry[0]() is not schedule:
            entry = (weakref.ref(schedule), op_counts(schedule.compute_streams()))
            self._counts[id(schedule)] = entry
            if len(self._counts) > _KEPT_COUNTS:
                self._counts.popitem(last=False)
        self._counts.move_to_end(id(schedule))
        return entry[1]

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, schedule: Schedule, key: tuple[Any, ...]
            ) -> tuple[Timeline, Execution] | None:
        """The run kept for `schedule` under `key` (None if none)."""
        entry = self._entries.get((id(schedule), key))
        if entry is None or entry[0] is not schedule:
            return None
        self._entries.move_to_end((id(schedule), key))
        self.hits += 1
        return entry[1], entry[2]

    def put(self, schedule: Schedule, key: tuple[Any, ...], timeline: Timeline,
            run: Execution) -> None:
        """Keep `schedule`'s run under `key`, dropping the least recently used beyond the
        budget (a run larger than all of it is not kept)."""
        ops = sum(len(ends) for ends in run.ends)
        if ops > self.max_ops:
            return
        old = self._entries.pop((id(schedule), key), None)
        if old is not None:
            self._ops -= old[3]
        self._entries[(id(schedule), key)] = (schedule, timeline, run, ops)
        self._ops += ops
        while self._ops > self.max_ops:
            self._ops -= self._entries.popitem(last=False)[1][3]
