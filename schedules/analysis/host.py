"""What the machine adds to the cost model: host work per op and the P2P link, measured or given.

A runtime spends time the cost model's F, I, W and B do not name: Python and autograd
around each op, posting sends and receives, bookkeeping between instructions. Measured on
a run whose op costs are known (emulated layers), that time is, for each compute op k of a
rank (legend: c_k its span, prev the end of the rank's previous compute op):

    host_k = (c_k.start - prev) - waits between them + (duration(c_k) - nominal(c_k))

where waits are the receive spans in between (time blocked on a peer is the schedule's,
not the host's). `HostCosts` keeps its mean per (kind, stage) (a mean, not a median: a
loaded host stalls now and then, and the stalls lengthen the step as much as the rest);
`with_host_costs` adds it to a `CostModel`, and the link's latency and bandwidth become its
message costs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np

from schedules.analysis.simulate import CostModel
from schedules.analysis.timeline import KIND_CODES, KINDS, Timeline
from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import Kind
from schedules.ir.schedule import Schedule

__all__ = ["HostCosts", "Link", "measure_host_costs", "with_host_costs"]

_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)
_WAITS = np.array([KIND_CODES[Kind.RECV_F], KIND_CODES[Kind.RECV_B]])


def _check_seconds(name: str, value: object, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ScheduleConfigError(f"{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class Link:
    """One P2P link as a ping-pong measures it: time = latency + bytes / bandwidth."""

    latency: float
    """Seconds of a message of no size, one way."""
    bandwidth: float | None = None
    """Bytes per second (None: bytes are free)."""

    def __post_init__(self) -> None:
        _check_seconds("latency", self.latency)
        if self.bandwidth is not None:
            _check_seconds("bandwidth", self.bandwidth, positive=True)


@dataclass(frozen=True)
class HostCosts:
    """Seconds of host work per compute op, by (kind, stage), beyond its nominal cost."""

    per_op: Mapping[tuple[Kind, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, value in self.per_op.items():
            _check_seconds(f"host cost of {key[1]}{key[0].value}", value)

    def of(self, kind: Kind, stage: int) -> float:
        """The host seconds of `kind` on `stage`; the kind's median over stages where this
        stage has none, 0 when the kind was never seen."""
        if (kind, stage) in self.per_op:
            return self.per_op[(kind, stage)]
        seen = [v for (k, _), v in self.per_op.items() if k is kind]
        return float(np.median(seen)) if seen else 0.0

    def mean(self) -> float:
        """The plain mean over (kind, stage) entries (0 when empty)."""
        return float(np.mean(list(self.per_op.values()))) if self.per_op else 0.0


def measure_host_costs(measured: Timeline, nominal: CostModel) -> HostCosts:
    """Mean host seconds per (kind, stage) of a measured run whose op costs were `nominal`
    (see the module docstring); negative estimates (an op ending early) count as 0."""
    if not isinstance(measured, Timeline) or not isinstance(nominal, CostModel):
        raise TypeError("measure_host_costs needs a measured Timeline and the nominal "
                        "CostModel its ops were given")
    num_stages = int(measured.stage[measured.compute_mask()].max()) + 1 if len(measured) else 0
    forward, backward, weight, _, _ = nominal.resolve(num_stages)
    cost = {Kind.F: forward, Kind.I: backward, Kind.W: weight,
            Kind.B: [b + w for b, w in zip(backward, weight)]}
    samples: dict[tuple[Kind, int], list[float]] = {}
    is_wait = np.isin(measured.kind, _WAITS)
    compute = measured.compute_mask()
    for rank in range(measured.num_ranks):
        rows = np.flatnonzero(measured.rank == rank)
        rows = rows[np.argsort(measured.start[rows], kind="stable")]
        if len(rows) == 0:
            continue
        previous = float(measured.start[rows[0]])
        waited = 0.0
        for row in rows.tolist():
            if is_wait[row]:
                waited += float(measured.end[row] - measured.start[row])
                continue
            if not compute[row]:
                continue
            kind = KINDS[int(measured.kind[row])]
            if kind is Kind.OVERLAP_B:  # the engine runs an overlapped pair's B as a plain B
                kind = Kind.B
            stage = int(measured.stage[row])
            start, end = float(measured.start[row]), float(measured.end[row])
            host = (start - previous) - waited + (end - start) - cost[kind][stage]
            samples.setdefault((kind, stage), []).append(max(host, 0.0))
            previous, waited = end, 0.0
    return HostCosts({key: float(np.mean(values)) for key, values in samples.items()})


def with_host_costs(costs: CostModel, host: HostCosts, schedule: Schedule,
                    link: Link | None = None) -> CostModel:
    """`costs` with each stage's host seconds added to its F, I (or B) and W, and the
    message costs of `link` (its latency as `comm`, its bandwidth for the activation bytes).

    The simulator charges a fused B backward + weight: on a stage whose backward
    `schedule` splits, I's host seconds go to backward and W's to weight; on the others
    B's go to backward.
    """
    if not isinstance(costs, CostModel) or not isinstance(host, HostCosts) or \
            not isinstance(schedule, Schedule):
        raise TypeError("with_host_costs needs a CostModel, a HostCosts and the Schedule")
    forward, backward, weight, _, act = costs.resolve(schedule.num_stages)
    split = {op.stage for stream in schedule.streams for op in stream if op.kind is Kind.I}
    # replace(): every other field of `costs` (overlap, reduction, gather, ...) carries over
    return replace(
        costs,
        forward=[f + host.of(Kind.F, s) for s, f in enumerate(forward)],
        backward=[b + host.of(Kind.I if s in split else Kind.B, s)
                  for s, b in enumerate(backward)],
        weight=[w + (host.of(Kind.W, s) if s in split else 0.0) for s, w in enumerate(weight)],
        comm=costs.comm if link is None else link.latency,
        activation_bytes=act,
        bandwidth=costs.bandwidth if link is None else link.bandwidth)
