"""A configuration's step from its simulated timeline: each rank's compute, data-parallel
reduction, tied all-reduce and optimizer step, the breakdown by cause, and the compute
limits past which the step is proven longer than a given time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.planner.stages import StageCosts
from pipeline.planner.tied import tied_through
from schedules import Timeline

__all__ = ["Beaten", "StepParts", "compute_limits", "step_breakdown", "step_parts"]

_MARGIN = 1e-12
"""Relative margin of `compute_limits` over the rounding of the few float additions that
turn a rank's compute end into its step (a handful of 2^-53 each)."""


@dataclass(frozen=True)
class Beaten:
    """A configuration whose simulation stopped once its step was proven longer than
    `threshold`: the search needs it neither in its top K nor on its Pareto front."""

    threshold: float


@dataclass(frozen=True)
class StepParts:
    """Per rank: when its compute ends, when it is ready for the step (its reduction and
    gathers done too), when it is through the tied all-reduce, and when its step ends."""

    rank_end: np.ndarray
    ready: np.ndarray
    synced: np.ndarray
    finish: np.ndarray
    waited: np.ndarray
    """Per rank, the time its forwards waited for an overlapped parameter gather."""


def step_parts(timeline: Timeline, ranks: int, step: np.ndarray, exposed: np.ndarray,
               tied: np.ndarray) -> StepParts:
    """A rank's step ends after its compute and its communication lane (the reduction, an
    overlapped gather), the tied all-reduce (`tied.tied_through`), its optimizer `step` and
    the `exposed` communication around it."""
    compute = timeline.compute_mask()
    rank_end = np.zeros(ranks)
    np.maximum.at(rank_end, timeline.rank[compute], timeline.end[compute])
    reduce_end = np.zeros(ranks)
    if timeline.reduction_ends:
        reduce_end = np.asarray(timeline.reduction_ends, dtype=np.float64)
    waited = np.zeros(ranks)
    if timeline.gather_ends:  # overlapped: the lane's early gathers, the forwards' waits
        reduce_end = np.maximum(reduce_end, timeline.gather_ends)
        waited = np.asarray(timeline.exposed_gather)
    ready = np.maximum(rank_end, reduce_end)
    synced = tied_through(ready, tied)  # then the step
    return StepParts(rank_end, ready, synced, synced + step + exposed, waited)


def step_breakdown(parts: StepParts, last: int, costs: StageCosts, mine: np.ndarray, m: int,
                   ep_comm: float, step: np.ndarray, exposed: np.ndarray) -> dict[str, float]:
    """Seconds of the step of rank `last` (the one that finishes last; `mine` marks its
    stages) by cause (`Prediction.breakdown`): they sum to its finish."""
    busy = m * float(costs.total[mine].sum())
    tp_comm = m * float(costs.tp_comm[mine].sum())
    recompute = m * float(costs.recompute[mine].sum())
    rank_end, ready, waited = parts.rank_end, parts.ready, parts.waited
    # the all-to-all's share of the rank's idle time, never more than that time
    ep_comm = min(ep_comm, max(float(rank_end[last] - busy - waited[last]), 0.0))
    cp = {} if costs.cp_comm is None else {"cp_comm": m * float(costs.cp_comm[mine].sum())}
    return {"compute": busy - tp_comm - recompute - sum(cp.values()), **cp,
            "recomputation": recompute, "tp_comm": tp_comm, "ep_comm": ep_comm,
            "bubble": float(rank_end[last] - busy - ep_comm - waited[last]),
            "dp_comm": float(ready[last] - rank_end[last] + exposed[last] + waited[last]),
            "tied_comm": float(parts.synced[last] - ready[last]),
            "optimizer": float(step[last])}


def compute_limits(threshold: float, step: np.ndarray, exposed: np.ndarray) -> list[float]:
    """Per rank, a compute end past which the step (`step_parts`: the largest `finish`) is
    longer than `threshold`: finish >= synced + step + exposed >= compute end + step +
    exposed, each addend >= 0 (and float addition is monotone), so a compute end past
    threshold - step - exposed, with a margin over that subtraction's rounding, is a step
    past the threshold."""
    return (threshold * (1.0 + _MARGIN) - (step + exposed)).tolist()
