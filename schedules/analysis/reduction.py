"""The data-parallel gradient reduction on a rank's timeline: when each bucket launches and ends.

The one rule the simulator (`simulate` with `CostModel.reduction`) and the planner share; it
is the engine's (`pipeline.parallel.data_parallel`, `pipeline.parallel.zero`):

- A stage's gradients are reduced in k equal buckets, its last layers' first (a backward
  makes them final first). Each rank has one communication lane: it runs one bucket at a
  time, in the order the rank launched them, and never blocks compute. A bucket of a stage
  whose whole reduction takes R lasts R/k.
- "overlap" (the engine's `overlap_grad_reduce=True`, DDP's and Megatron's hooks): when a
  stage's last backward op of the step is a fused B (or OVERLAP_B), spanning [a, a + L], its
  buckets launch from that op's gradient hooks as each becomes final; the parameters are
  taken to become final at an even pace through the op:

      bucket j of k final at  a + (j + 1)/k · L

  for a plain all-reduce and for ZeRO-1 alike: the engine shards each bucket d ways
  (Megatron's distributed optimizer, `pipeline.parallel.zero_layout`), so a bucket's
  reduce-scatter needs only that bucket final; ZeRO-1 differs in the time only (a
  reduce-scatter, half an all-reduce's traffic: `ring_reduction_time`). A stage whose last
  backward op is a split I or W launches everything at its REDUCE_GRAD: the engine's hooks
  skip those (`pipeline.runtime.stream_scan.last_backwards`).
- "after_backward" (`overlap_grad_reduce=False`): all k buckets at the stage's REDUCE_GRAD,
  i.e. when the compute op before it in the rank's stream ends (`add_optimizer_step` puts
  it right after the stage's last backward, so one chunk's reduction overlaps the next
  chunk's compute).
- "after_flush": all at the end of the rank's compute (Megatron-LM as Narayanan et al.
  2021 ran it: the all-reduce after the pipeline flush).

The lane, bucket n of the rank in launch order:  start_n = max(launch_n, end_{n-1}),
end_n = start_n + R_n/k_n.  The step ends when the rank's compute and its lane both have;
the exposed reduction is that end minus the end of the rank's compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from schedules.ir.instructions import COMPUTE_KINDS, Instruction, Kind

__all__ = ["REDUCTION_STARTS", "BucketSpan", "Lane", "ReductionStart", "StageLaunch",
           "bucket_ready", "reduce_rank", "ring_reduction_time", "stage_launches"]

ReductionStart = Literal["overlap", "after_backward", "after_flush"]
REDUCTION_STARTS: tuple[ReductionStart, ...] = ("overlap", "after_backward", "after_flush")
_BACKWARD = frozenset({Kind.B, Kind.OVERLAP_B, Kind.I, Kind.W})
_HOOKED = frozenset({Kind.B, Kind.OVERLAP_B})


class StageLaunch(NamedTuple):
    """Where a stage's reduction can start on its rank."""

    stage: int
    backward_start: float
    """Start of the stage's last backward op of the step."""
    backward_end: float
    hooked: bool
    """That op is a fused B (or OVERLAP_B): gradient hooks may launch buckets inside it."""
    reduce_grad: float
    """When the stage's REDUCE_GRAD runs: the end of the compute op before it."""
    order: int
    """Position of the REDUCE_GRAD (or of the last backward op) in the rank's stream."""


class BucketSpan(NamedTuple):
    """One bucket's reduction on its rank's communication lane."""

    rank: int
    stage: int
    bucket: int
    """Index in the stage's launch order (0 = its last layers' gradients)."""
    launch: float
    start: float
    end: float


class Lane(NamedTuple):
    """A rank's buckets on its communication lane, in the order they run, as columns (the
    planner reduces thousands of buckets per configuration)."""

    rank: int
    stage: np.ndarray
    bucket: np.ndarray
    launch: np.ndarray
    start: np.ndarray
    end: np.ndarray

    @property
    def finish(self) -> float:
        """When the lane's last bucket ends (0 when it has none)."""
        return float(self.end[-1]) if len(self.end) else 0.0

    def spans(self) -> list[BucketSpan]:
        """The buckets as `BucketSpan` rows."""
        return [BucketSpan(self.rank, *row) for row in zip(
            self.stage.tolist(), self.bucket.tolist(), self.launch.tolist(),
            self.start.tolist(), self.end.tolist())]


def bucket_ready(start: float, end: float, buckets: int) -> np.ndarray:
    """When each of a stage's `buckets` (in launch order) is final inside a backward op
    spanning [start, end]: at the (j + 1)/k points of the op (module docstring)."""
    if buckets < 1:
        raise ValueError(f"buckets must be >= 1, got {buckets}")
    done = np.arange(1, buckets + 1) / buckets
    return start + done * (end - start)


def stage_launches(stream: Sequence[Instruction], starts: Sequence[float],
                   ends: Sequence[float], stages: Sequence[int]) -> list[StageLaunch]:
    """Each of `stages`' last backward op and REDUCE_GRAD in one rank's `stream`, given the
    start and end of every compute op of the stream in order (`starts`, `ends`).

    A stream without REDUCE_GRAD (compute only) reduces where `add_optimizer_step` would put
    it: right after the stage's last backward. A stage without a backward has no gradient
    to reduce and is left out.
    """
    n = len(starts)
    remaining = set(stages)
    after = 0  # compute ops seen so far, scanning from the stream's end
    reduce_at: dict[int, tuple[int, int]] = {}
    last: dict[int, tuple[int, Kind, int]] = {}
    # a REDUCE_GRAD comes after its stage's last backward: the scan stops at the last one
    for k in range(len(stream) - 1, -1, -1):
        if not remaining:
            break
        kind, stage = stream[k][0], stream[k][1]
        if kind is Kind.REDUCE_GRAD:
            reduce_at.setdefault(stage, (n - 1 - after, k))
        elif kind in COMPUTE_KINDS:
            if kind in _BACKWARD and stage in remaining:
                remaining.discard(stage)
                last[stage] = (n - 1 - after, kind, k)
            after += 1
    launches = []
    for stage, (row, kind, k) in last.items():
        before, order = reduce_at.get(stage, (row, k))
        launches.append(StageLaunch(stage, float(starts[row]), float(ends[row]),
                                    kind in _HOOKED, float(ends[before]) if before >= 0 else 0.0,
                                    order))
    return sorted(launches, key=lambda launch: launch.order)


def reduce_rank(rank: int, launches: Sequence[StageLaunch], seconds: Sequence[float],
                buckets: Sequence[int], *, start: ReductionStart,
                compute_end: float = 0.0, free_at: float = 0.0) -> Lane:
    """The rank's buckets on its communication lane, in launch order (module docstring).

    `seconds[s]` is stage s's whole reduction, `buckets[s]` its bucket count; `compute_end`
    the end of the rank's compute; `free_at` when the lane is free of what ran on it before
    (the previous step's overlapped parameter gathers, `schedules.analysis.gather`).
    """
    if start not in REDUCTION_STARTS:
        raise ValueError(f"start must be one of {', '.join(REDUCTION_STARTS)}, got {start!r}")
    if not launches:
        empty = np.zeros(0)
        return Lane(rank, empty.astype(np.int64), empty.astype(np.int64), empty, empty, empty)
    ready, order, bucket, stage, length = [], [], [], [], []
    for launch in launches:
        s, k = launch.stage, buckets[launch.stage]
        if start == "after_flush":
            times = np.full(k, compute_end)
        elif start == "overlap" and launch.hooked:
            # strictly in bucket order, so that every replica issues the same collectives in
            # the same order: a final bucket waits for the ones before it
            times = np.maximum.accumulate(
                bucket_ready(launch.backward_start, launch.backward_end, k))
        else:
            times = np.full(k, launch.reduce_grad)
        ready.append(times)
        order.append(np.full(k, launch.order))
        bucket.append(np.arange(k))
        stage.append(np.full(k, s))
        length.append(np.full(k, seconds[s] / k))
    launch_at, rank_order, index, stage_of, duration = (
        np.concatenate(x) for x in (ready, order, bucket, stage, length))
    # FIFO: launched earlier goes first; at one time, the earlier REDUCE_GRAD, then bucket order
    fifo = np.lexsort((index, rank_order, launch_at))
    launch_at, index, stage_of, duration = (x[fifo] for x in (launch_at, index, stage_of,
                                                               duration))
    # end_n = max(end_{n-1}, launch_n) + d_n, unrolled: end_n = D_n + max_{i<=n}(launch_i -
    # D_{i-1}) with D the running sum of durations (no Python loop over thousands of buckets)
    total = np.cumsum(duration)
    runnable = np.maximum(launch_at, free_at)
    end = total + np.maximum.accumulate(runnable - (total - duration))
    return Lane(rank, stage_of, index, launch_at, np.maximum(end - duration, runnable), end)


def ring_reduction_time(nbytes: float, data_parallel: int, bandwidth: float, *,
                        zero_stage: int = 0, latency: float = 0.0) -> float:
    """A ring all-reduce of `nbytes` over `data_parallel` ranks: 2(d - 1) steps of n/d bytes
    each (Patarasuk & Yuan 2009); ZeRO-1's reduce-scatter is its first half."""
    d = data_parallel
    if d <= 1:
        return 0.0
    steps = (d - 1) * (1 if zero_stage else 2)
    return steps * (nbytes / d / bandwidth + latency)
