"""Cost-model simulator: run a schedule's streams with per-stage costs into a `Timeline`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from schedules.analysis.all_to_all import op_spans, overlapped_pair, two_batch_forward
from schedules.analysis.costs import CostModel, GradReduction, ParamGather, per_stage
from schedules.analysis.dataflow import Execution, execute
from schedules.analysis.gather import forward_release, gather_lane
from schedules.analysis.reduction import Lane, reduce_rank, stage_launches
from schedules.analysis.runs import ComputeRuns
from schedules.analysis.timeline import KIND_CODES, Timeline
from schedules.ir.errors import ScheduleConfigError, ScheduleValidationError
from schedules.ir.grid import format_grid
from schedules.ir.instructions import NONE, Instruction, Kind
from schedules.ir.schedule import Schedule, gc_paused

__all__ = ["CostModel", "GradReduction", "ParamGather", "reduce_gradients", "simulate",
           "simulate_unless_over"]


@gc_paused
def simulate(schedule: Schedule, costs: CostModel | None = None, *,
             runs: ComputeRuns | None = None) -> Timeline:
    """Execute every rank's compute stream in order under `costs` (`schedules.analysis.dataflow`).

    Communication instructions of a lowered schedule add no time of their own: their cost
    is the `comm` delay on the dependency they carry. With `costs.reduction` each rank's
    gradient buckets run on its communication lane (`reduce_gradients`): one REDUCE_GRAD row
    per bucket of nonzero time, and `Timeline.reduction_ends`. Run `validate` first on
    schedules from outside; an order that can never finish raises `ScheduleValidationError`.
    `runs` keeps the compute run for calls on the same schedule and compute costs
    (`ComputeRuns`; not where an overlapped gather delays the forwards).
    """
    timeline = _simulate(schedule, costs, runs, None)
    assert timeline is not None  # no limit: never stopped
    return timeline


@gc_paused
def simulate_unless_over(schedule: Schedule, costs: CostModel | None, limit: Sequence[float],
                         *, runs: ComputeRuns | None = None) -> Timeline | None:
    """`simulate`, or None as soon as a rank's compute is proven to end past `limit[rank]`
    (`dataflow.execute`; checked exactly once the compute has run, before the lanes are
    laid): a run whose every rank ends by its limit is simulated whole. A stopped run is
    not kept in `runs`."""
    if len(limit) != schedule.num_ranks:
        raise ValueError(f"limit has {len(limit)} values for {schedule.num_ranks} ranks; "
                         "give one per rank")
    return _simulate(schedule, costs, runs, limit)


def _simulate(schedule: Schedule, costs: CostModel | None, runs: ComputeRuns | None,
              limit: Sequence[float] | None) -> Timeline | None:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"simulate needs a schedules.Schedule (e.g. from build_schedule), got "
                        f"{schedule!r}")
    if costs is not None and not isinstance(costs, CostModel):
        raise TypeError(f"costs must be a schedules.CostModel or None, got {costs!r}")
    costs = costs or CostModel()
    forward, backward, weight, delay, act = costs.resolve(schedule.num_stages)
    gather = costs.gather if schedule.has_backward else None
    release = None
    if gather is not None and gather.overlap:
        release = _first_forward_release(schedule, schedule.compute_streams(), gather,
                                         forward)
    key = None
    if runs is not None and release is None:  # every input of the compute run
        a2a = costs.all_to_all
        key = (tuple(forward), tuple(backward), tuple(weight), tuple(delay), tuple(act),
               costs.overlap, None if a2a is None else (
                   tuple(per_stage("all_to_all.forward", a2a.forward, schedule.num_stages)),
                   tuple(per_stage("all_to_all.backward", a2a.backward,
                                    schedule.num_stages)), a2a.two_batch))
    kept = None if key is None or runs is None else runs.get(schedule, key)
    if kept is None:
        # a non-compute op takes no time of its own
        counts = None if limit is None or runs is None else runs.op_counts(schedule)
        made = _run_compute(schedule, schedule.compute_streams(), costs, release,
                            forward, backward, weight, delay, act, limit, counts)
        if made is None:
            return None
        timeline, run = made
        if key is not None and runs is not None:
            runs.put(schedule, key, timeline, run)
    else:
        timeline, run = kept
    if limit is not None and any(max(ends, default=0.0) > most
                                 for ends, most in zip(run.ends, limit)):
        return None
    if gather is None:
        if costs.reduction is None or not schedule.has_backward:
            return timeline
        return _with_reduction(timeline, reduce_gradients(schedule, run, costs.reduction))
    gathers = gather.resolve(schedule.num_stages)
    # overlapped, the previous step's gathers hold the lane from the step's start
    free = [sum(gathers[0][s] for s in schedule.stages_of(rank)) if gather.overlap else 0.0
            for rank in range(schedule.num_ranks)]
    lanes = None if costs.reduction is None else \
        reduce_gradients(schedule, run, costs.reduction, free_at=free)
    timeline = timeline if lanes is None else _with_reduction(timeline, lanes)
    return _with_gather(timeline, schedule, run, gathers, gather.overlap, lanes)


def _run_compute(schedule: Schedule, streams: Sequence[Sequence[Instruction]],
                 costs: CostModel, release: dict[int, float] | None, forward: list[float],
                 backward: list[float], weight: list[float], delay: list[float],
                 act: list[float], limit: Sequence[float] | None = None,
                 counts: Sequence[Mapping[tuple[Kind, int], int]] | None = None
                 ) -> tuple[Timeline, Execution] | None:
    """The compute streams executed (`dataflow.execute`) and their timeline, with the
    expert all-to-all's rows where `costs` has one; None when a rank is proven to end past
    its `limit`."""
    compute_forward, compute_backward = forward, backward
    pair, two_batch = None, False
    if costs.all_to_all is not None:
        two_batch = costs.all_to_all.two_batch
        a2a_forward = per_stage("all_to_all.forward", costs.all_to_all.forward,
                                 schedule.num_stages)
        a2a_backward = per_stage("all_to_all.backward", costs.all_to_all.backward,
                                  schedule.num_stages)
        pair = _pair_pricer(forward, backward, weight, a2a_forward, a2a_backward, two_batch)
        # `execute` prices every F outside a pair by this list (a paired F: by `pair`)
        forward = [_alone_forward(f, a, two_batch) for f, a in zip(forward, a2a_forward)]
        backward = [b + a for b, a in zip(backward, a2a_backward)]
    run = execute(streams, schedule.placement, schedule.num_microbatches, forward, backward,
                  weight, delay, costs.overlap, release, pair, limit, counts)
    if run.over is not None:
        return None
    if run.stuck:
        rank, step = min(run.stuck.items())
        raise ScheduleValidationError(
            f"{schedule.name}: rank {rank} waits forever at step {step} ({streams[rank][step]})",
            rank=rank, step=step, grid=format_grid(streams, rank, step))
    # every rank's ops in one column each, rank 0's first, read in C (itemgetter over the
    # flattened ops: cheaper than per-op attribute reads, or than transposing with zip)
    lengths = [len(stream) for stream in streams]
    count = sum(lengths)
    ops = list(chain.from_iterable(streams))

    def column(index: int) -> Iterator[Any]:
        return map(itemgetter(index), ops)

    ends = np.fromiter(chain.from_iterable(run.ends), dtype=np.float64, count=count)
    if not np.isfinite(ends).all():  # each cost is finite, their sum overflowed
        raise ScheduleConfigError(
            f"{schedule.name}: the costs sum past the largest float (an op of "
            f"{max(max(forward), max(backward), max(weight), max(delay)):.3g} time units): the "
            "makespan would be inf; express the costs in a larger unit (e.g. ms instead of ns)")
    timeline = Timeline(
        schedule.num_ranks, np.repeat(np.arange(len(streams), dtype=np.int32), lengths),
        np.fromiter(map(KIND_CODES.__getitem__, column(0)), dtype=np.int8, count=count),
        np.fromiter(column(1), dtype=np.int32, count=count),
        np.fromiter(column(2), dtype=np.int32, count=count),
        np.fromiter(chain.from_iterable(run.starts), dtype=np.float64, count=count), ends,
        name=schedule.name, num_microbatches=schedule.num_microbatches, chunks=schedule.chunks,
        activation_bytes=tuple(act))
    if costs.all_to_all is not None:
        timeline = _with_all_to_all(timeline, streams, run, compute_forward, compute_backward,
                                    weight, a2a_forward, a2a_backward, two_batch)
    return timeline, run


def _alone_forward(compute: float, all_to_all: float, two_batch: bool) -> float:
    """An F outside an overlapped pair: compute + all-to-all, exposed; with two-batch overlap
    on a stage with an all-to-all, its two halves' time (`two_batch_forward`)."""
    if two_batch and all_to_all > 0:
        return two_batch_forward(compute, all_to_all).end
    return compute + all_to_all


def _pair_pricer(forward: Sequence[float], backward: Sequence[float], weight: Sequence[float],
                 a2a_forward: Sequence[float], a2a_backward: Sequence[float],
                 two_batch: bool) -> Callable[[int, int], tuple[float, float]]:
    """(F span, B span) of an overlapped pair F(s) + OVERLAP_B(s2): the pair's time from
    `overlapped_pair`, shown split in proportion of the two ops' compute."""
    cache: dict[tuple[int, int], tuple[float, float]] = {}

    def price(s: int, s2: int) -> tuple[float, float]:
        if (s, s2) not in cache:
            fused = backward[s2] + weight[s2]
            total = overlapped_pair(forward[s], a2a_forward[s], fused, a2a_backward[s2],
                                    two_batch=two_batch).end
            share = forward[s] / (forward[s] + fused) if forward[s] + fused > 0 else 0.5
            cache[(s, s2)] = (total * share, total * (1 - share))
        return cache[(s, s2)]
    return price


def _with_all_to_all(timeline: Timeline, streams: Sequence[Sequence[Instruction]],
                     run: Execution, forward: Sequence[float], backward: Sequence[float],
                     weight: Sequence[float], a2a_forward: Sequence[float],
                     a2a_backward: Sequence[float], two_batch: bool = False) -> Timeline:
    """`timeline` with an ALL_TO_ALL row per all-to-all part that takes time, on each rank's
    all-to-all lane (`schedules.analysis.all_to_all`: `op_spans` for an op alone, the
    pair's lane for an overlapped pair, `two_batch_forward`'s for a two-batch F)."""
    rows: list[tuple[int, int, int, float, float]] = []
    for rank, stream in enumerate(streams):
        starts, k, n = run.starts[rank], 0, len(stream)
        while k < n:
            kind, s, i, _ = stream[k]
            if kind is Kind.F and k + 1 < n and stream[k + 1][0] is Kind.OVERLAP_B:
                s2, i2 = stream[k + 1][1], stream[k + 1][2]
                laid = overlapped_pair(forward[s], a2a_forward[s], backward[s2] + weight[s2],
                                       a2a_backward[s2], two_batch=two_batch)
                owner = {"F": (s, i), "B": (s2, i2)}
                rows += [(rank, *owner[part.op], starts[k] + part.start, starts[k] + part.end)
                         for part in laid.lane]
                k += 2
                continue
            if kind is Kind.F and two_batch and a2a_forward[s] > 0:
                parts = two_batch_forward(forward[s], a2a_forward[s]).lane
            elif kind is Kind.F:
                parts = op_spans("F", forward[s], a2a_forward[s])
            elif kind in (Kind.B, Kind.I, Kind.OVERLAP_B):
                compute = backward[s] + (0.0 if kind is Kind.I else weight[s])
                parts = op_spans("B", compute, a2a_backward[s])
            else:
                parts = ()
            rows += [(rank, s, i, starts[k] + part.start, starts[k] + part.end)
                     for part in parts]
            k += 1
    rows = [row for row in rows if row[4] > row[3]]
    columns = list(zip(*rows)) if rows else [()] * 5
    code = KIND_CODES[Kind.ALL_TO_ALL]

    def column(base: np.ndarray, values: Sequence[float]) -> np.ndarray:
        return np.concatenate([base, np.asarray(values, dtype=base.dtype)])

    return replace(
        timeline, rank=column(timeline.rank, columns[0]),
        kind=column(timeline.kind, [code] * len(rows)),
        stage=column(timeline.stage, columns[1]),
        microbatch=column(timeline.microbatch, columns[2]),
        start=column(timeline.start, columns[3]), end=column(timeline.end, columns[4]))


def _first_forward_release(schedule: Schedule, streams: Sequence[Sequence[Instruction]],
                           gather: ParamGather, forward: Sequence[float]) -> dict[int, float]:
    """Overlapped gathers: the earliest start of each stage's first F of the step, keyed
    s·m + i as `execute` reads it (`schedules.analysis.gather`)."""
    times, buckets, layers = gather.resolve(schedule.num_stages)
    m = schedule.num_microbatches
    release: dict[int, float] = {}
    for rank, stream in enumerate(streams):
        stage_of, _, _, end = gather_lane(schedule.stages_of(rank), times, buckets, 0.0)
        first: dict[int, int] = {}
        for op in stream:
            if op[0] is Kind.F:
                first.setdefault(op[1], op[2])
        for s, i in first.items():
            release[s * m + i] = forward_release(end[stage_of == s], forward[s], layers[s])
    return release


def reduce_gradients(schedule: Schedule, run: Execution, reduction: GradReduction,
                     free_at: Sequence[float] | None = None) -> list[Lane]:
    """Per rank, its buckets on its communication lane, given the executed compute `run`
    (the lane free from `free_at[rank]`, 0 by default)."""
    times, buckets = reduction.resolve(schedule.num_stages)
    spans = []
    for rank, stream in enumerate(schedule.streams):
        starts, ends = run.starts[rank], run.ends[rank]
        launches = stage_launches(stream, starts, ends, schedule.stages_of(rank))
        spans.append(reduce_rank(rank, launches, times, buckets, start=reduction.start,
                                 compute_end=float(max(ends, default=0.0)),
                                 free_at=free_at[rank] if free_at else 0.0))
    return spans


def _with_reduction(timeline: Timeline, lanes: list[Lane]) -> Timeline:
    """`timeline` with a REDUCE_GRAD row per bucket that takes time, and each rank's end of
    the reduction (0 where it has none)."""
    kept = [lane.end > lane.start for lane in lanes]
    rows = [int(keep.sum()) for keep in kept]
    return replace(
        _with_rows(timeline, Kind.REDUCE_GRAD, [np.full(n, lane.rank) for n, lane in
                                                zip(rows, lanes)],
                   [lane.stage[k] for lane, k in zip(lanes, kept)],
                   [lane.start[k] for lane, k in zip(lanes, kept)],
                   [lane.end[k] for lane, k in zip(lanes, kept)]),
        reduction_ends=tuple(lane.finish for lane in lanes))


def _with_gather(timeline: Timeline, schedule: Schedule, run: Execution,
                 gathers: tuple[list[float], list[int], list[int | None]], overlap: bool,
                 lanes: list[Lane] | None) -> Timeline:
    """`timeline` with a STEP row per gather bucket that takes time (on the rank's lane),
    each rank's end of its gathers and its exposed gather (`schedules.analysis.gather`)."""
    times, buckets, _ = gathers
    ranks, stages, starts, ends, finish, exposed = [], [], [], [], [], []
    for rank in range(schedule.num_ranks):
        compute_end = float(max(run.ends[rank], default=0.0))
        start = 0.0 if overlap else max(compute_end, lanes[rank].finish if lanes else 0.0)
        stage_of, _, begin, end = gather_lane(schedule.stages_of(rank), times, buckets, start)
        kept = end > begin
        ranks.append(np.full(int(kept.sum()), rank))
        stages.append(stage_of[kept])
        starts.append(begin[kept])
        ends.append(end[kept])
        finish.append(float(end[-1]) if len(end) else 0.0)
        waited = run.waited[rank] if run.waited is not None else 0.0
        exposed.append(waited if overlap else max(finish[-1] - start, 0.0))
    return replace(_with_rows(timeline, Kind.STEP, ranks, stages, starts, ends),
                   gather_ends=tuple(finish), exposed_gather=tuple(exposed))


def _with_rows(timeline: Timeline, kind: Kind, ranks: list[np.ndarray],
               stages: list[np.ndarray], starts: list[np.ndarray], ends: list[np.ndarray]
               ) -> Timeline:
    """`timeline` with rows of `kind` (no microbatch) appended."""
    def column(base: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([base, *(part.astype(base.dtype) for part in parts)])

    count = sum(len(part) for part in ranks)
    return replace(
        timeline, rank=column(timeline.rank, ranks),
        kind=column(timeline.kind, [np.full(count, KIND_CODES[kind])]),
        stage=column(timeline.stage, stages),
        microbatch=column(timeline.microbatch, [np.full(count, NONE)]),
        start=column(timeline.start, starts), end=column(timeline.end, ends))
