"""Timelines of executed ops (simulated or measured) and the figures read off them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from schedules.analysis.accounting import HeldTrace
from schedules.ir.instructions import Kind

__all__ = ["KINDS", "KIND_CODES", "Figures", "Span", "Timeline", "figures"]

KINDS: tuple[Kind, ...] = tuple(Kind)
"""Kind of code n in `Timeline.kind` is KINDS[n]."""
KIND_CODES: dict[Kind, int] = {kind: code for code, kind in enumerate(KINDS)}
_COMPUTE_CODES = np.array([KIND_CODES[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W,
                                                    Kind.OVERLAP_B)])
_F, _B, _I, _W = (KIND_CODES[k] for k in (Kind.F, Kind.B, Kind.I, Kind.W))
_STEP = KIND_CODES[Kind.STEP]


class Span(NamedTuple):
    """One executed op: where, what, and when."""

    rank: int
    kind: Kind
    stage: int
    microbatch: int
    start: float
    end: float


def _column(values: Any, dtype: Any) -> np.ndarray:
    array = np.asarray(values, dtype=dtype)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class Timeline:
    """Executed ops as columns (one row an op), so a million of them stay cheap.

    `kind` holds codes into `KINDS`. Compute ops (F, B, I, W) carry the figures; a measured
    run may add communication rows too, and a simulation with a gradient reduction one
    REDUCE_GRAD row per bucket, on the rank's communication lane (overlapping its compute).
    `unit` is "units" for cost-model time, "s" for seconds of a measured run.
    """

    num_ranks: int
    rank: np.ndarray
    kind: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    start: np.ndarray
    end: np.ndarray
    name: str = ""
    num_microbatches: int = 0
    chunks: int = 1
    unit: str = "units"
    activation_bytes: tuple[float, ...] = field(default=())
    """Bytes of one microbatch's activations, per stage (empty when unknown)."""
    reduction_ends: tuple[float, ...] = field(default=())
    """Per rank, when its data-parallel gradient reduction ends (a simulation with
    `CostModel.reduction`; empty otherwise): the rank's step ends at the later of this and
    its last compute op."""
    gather_ends: tuple[float, ...] = field(default=())
    """Per rank, when its ZeRO-1 parameter gathers end (a simulation with `CostModel.gather`;
    empty otherwise); blocking, the step ends with them; overlapped, they run from its start."""
    exposed_gather: tuple[float, ...] = field(default=())
    """Per rank, the time it waited for its parameter gathers (empty without them)."""

    def __post_init__(self) -> None:
        for name, dtype in (("rank", np.int32), ("kind", np.int8), ("stage", np.int32),
                            ("microbatch", np.int32), ("start", np.float64), ("end", np.float64)):
            object.__setattr__(self, name, _column(getattr(self, name), dtype))
        lengths = {len(getattr(self, n)) for n in ("rank", "kind", "stage", "microbatch",
                                                    "start", "end")}
        if len(lengths) != 1:
            raise ValueError(f"timeline columns differ in length: {sorted(lengths)}")

    def __len__(self) -> int:
        return len(self.start)

    def spans(self) -> Iterator[Span]:
        """Rows as `Span` values (for tests and small timelines)."""
        for row in zip(self.rank.tolist(), self.kind.tolist(), self.stage.tolist(),
                       self.microbatch.tolist(), self.start.tolist(), self.end.tolist()):
            yield Span(row[0], KINDS[row[1]], row[2], row[3], row[4], row[5])

    @classmethod
    def from_spans(cls, spans: Sequence[Span], num_ranks: int, **meta: Any) -> Timeline:
        """Build from rows, e.g. the spans a measured run recorded."""
        rows: list[tuple[Any, ...]] = list(zip(*spans)) if spans else [()] * 6
        kinds = np.asarray([KIND_CODES[k] for k in rows[1]], dtype=np.int8)
        rank, stage, microbatch, start, end = (np.asarray(rows[n]) for n in (0, 2, 3, 4, 5))
        return cls(num_ranks, rank, kinds, stage, microbatch, start, end, **meta)

    def compute_mask(self) -> np.ndarray:
        """True on rows that are F, B, I or W."""
        return np.isin(self.kind, _COMPUTE_CODES)


@dataclass(frozen=True)
class Figures:
    """What a timeline costs. Definitions follow the Zero Bubble paper (Qi et al. 2024):
    a rank's span runs from its first op's start to its last op's end; cost is the longest
    span; bubble_rate = 1 - max per-rank busy compute / cost."""

    makespan: float
    bubble_rate: float
    idle_fraction: float
    """1 - all busy compute / (ranks × makespan): the whole pipeline's idle share."""
    busy: tuple[float, ...]
    peak_activations: tuple[int, ...]
    """Most (stage, microbatch) activations a rank holds at once, counted along the rank's
    order of ops (`held_peaks`, `predict_memory` and the searches count the same): taken
    at F, freed by the last backward op (B, or W when the backward is split); an F with
    no backward (inference) holds its activation while it runs."""
    peak_activation_bytes: tuple[float, ...]
    step: float | None = None
    """With a simulated gradient reduction (`Timeline.reduction_ends`): from the first op's
    start until every rank's compute and reduction have ended; None without one."""
    exposed_reduction: tuple[float, ...] = ()
    """Per rank, how long its reduction runs past its last compute op (empty without one)."""
    exposed_gather: tuple[float, ...] = ()
    """Per rank, the time it waits for ZeRO-1's parameter gathers (`Timeline.exposed_gather`;
    empty without them)."""

    def to_dict(self) -> dict[str, Any]:
        ranks: list[dict[str, Any]] = [
            {"rank": r, "busy": b, "peak_activations": a, "peak_activation_bytes": y}
            for r, (b, a, y) in enumerate(zip(self.busy, self.peak_activations,
                                              self.peak_activation_bytes))]
        reduction: dict[str, Any] = {}
        if self.step is not None:
            reduction = {"step": self.step}
            for rank, exposed in zip(ranks, self.exposed_reduction):
                rank["exposed_reduction"] = exposed
            for rank, exposed in zip(ranks, self.exposed_gather):
                rank["exposed_gather"] = exposed
        return {"makespan": self.makespan, "bubble_rate": self.bubble_rate,
                "idle_fraction": self.idle_fraction, **reduction, "ranks": ranks}


def figures(timeline: Timeline) -> Figures:
    """Makespan, bubble rate, idle fraction, per-rank busy time and peak activations."""
    if not isinstance(timeline, Timeline):
        raise TypeError(f"figures needs a schedules.Timeline (from simulate, or a measured "
                        f"run's), got {timeline!r:.80}")
    p = timeline.num_ranks
    mask = timeline.compute_mask()
    rank, kind = timeline.rank[mask], timeline.kind[mask]
    start, end = timeline.start[mask], timeline.end[mask]
    if len(start) == 0:
        zeros = (0.0,) * p
        return Figures(0.0, 0.0, 0.0, zeros, (0,) * p, zeros)
    busy = np.bincount(rank, weights=end - start, minlength=p)
    first = np.full(p, np.inf)
    last = np.full(p, -np.inf)
    np.minimum.at(first, rank, start)
    np.maximum.at(last, rank, end)
    active = np.isfinite(first)
    cost = float((last - first)[active].max())
    makespan = float(end.max() - start.min())
    bubble_rate = 1.0 - float(busy.max()) / cost if cost > 0 else 0.0
    idle = 1.0 - float(busy.sum()) / (p * makespan) if makespan > 0 else 0.0
    counts, byte_peaks = _peak_activations(timeline, rank, kind, timeline.stage[mask],
                                           timeline.microbatch[mask], start, end)
    step, exposed = None, ()
    if timeline.reduction_ends or timeline.gather_ends:
        lane = np.full(p, -np.inf)
        origin = float(start.min())
        if timeline.reduction_ends:
            reduced = np.asarray(timeline.reduction_ends, dtype=np.float64)
            lane = np.maximum(lane, reduced)
            exposed = tuple(np.where(active, np.maximum(reduced - last, 0.0), 0.0).tolist())
        if timeline.gather_ends:
            lane = np.maximum(lane, np.asarray(timeline.gather_ends, dtype=np.float64))
            gathers = timeline.kind == _STEP  # overlapped, they start the step
            if gathers.any():
                origin = min(origin, float(timeline.start[gathers].min()))
        step = float(np.maximum(last, lane).max() - origin)
    return Figures(makespan, bubble_rate, idle, tuple(busy.tolist()), counts, byte_peaks,
                   step, exposed, timeline.exposed_gather)


_KIND_IDS = np.array([id(kind) for kind in KINDS], dtype=np.int64)


def _peak_activations(timeline: Timeline, rank: np.ndarray, kind: np.ndarray,
                      stage: np.ndarray, microbatch: np.ndarray, start: np.ndarray,
                      end: np.ndarray) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Peaks counted from each rank's order of ops (`HeldTrace`, `stream_peak`'s count),
    never from the clock: ops that take no time start together but still run in their
    stream's order. The order is by start time, ties kept in row order (a simulated
    timeline lists each rank's ops in stream order)."""
    p = timeline.num_ranks
    order = np.lexsort((np.arange(len(rank)), start, rank))
    lengths = np.bincount(rank, minlength=p)
    trace = HeldTrace.of_columns(
        lengths, _KIND_IDS[kind[order]], stage[order].astype(np.int64),
        microbatch[order].astype(np.int64), int(stage.max()) + 1, int(microbatch.max()) + 1)
    counts = trace.peaks()
    if not timeline.activation_bytes:
        return counts, (0.0,) * p
    per_stage = np.zeros(int(stage.max()) + 1)
    known = min(len(per_stage), len(timeline.activation_bytes))
    per_stage[:known] = timeline.activation_bytes[:known]
    return counts, tuple(float(x) for x in trace.peak_bytes(per_stage))
