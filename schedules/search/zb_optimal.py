"""zb-optimal: the minimum-makespan split-backward schedule under a memory limit, by CP-SAT.

Why CP-SAT (OR-Tools) rather than a MIP solver such as HiGHS: the problem is a job shop
with one machine per rank (ops on a rank never overlap) and a memory reservoir per rank
(an activation is held from its F's start to its W's end). CP-SAT states both natively,
as `AddNoOverlap` and `AddCumulative` over interval variables, and reasons on them with
dedicated propagators and lazy clauses; a MIP needs a big-M disjunction for every pair of
ops on a rank, whose LP relaxation is weak, so it proves far less in the same time.

The model (S stages, stage s on rank placement[s], m microbatches; all times integers
after scaling the costs to a common denominator):
    F(s,i) >= end F(s-1,i) + d,  I(s,i) >= end F(s,i),  I(s,i) >= end I(s+1,i) + d,
    W(s,i) >= end I(s,i)         (d: the comm delay when the two stages are on two ranks)
    per stage, F, I and W each run in microbatch order (as every schedule here does),
    per rank, no two ops overlap, and at most K intervals [start F, end W) overlap,
    minimise the makespan. Started from the best heuristic's order as a hint.

Exactness. Costs are read as the decimals they print as (0.9996 is 2499/2500) and scaled
to integers without loss when the common denominator is small enough
(`zb_optimal_model._EXACT_SCALE`); then `proven` means optimal for the given costs.
Otherwise they are rounded to a time unit of at most 1/10000: the solver's proof holds for
the rounded costs only (`optimal_for_rounded_costs`), `proven` stays False and `bound` is
the rounded bound minus the most rounding any chain of ops can accumulate, a bound for the
true costs.
Memory is counted on the order, as every peak count here is (`stream_peak`): an
activation is taken at its F and freed at its W in the rank's stream. Ops that take no
time still run in an order, so memory and precedence are stated on a refined axis of R
ticks per time unit (R = 1 + the ops of no time + 1): an op of length d > 0 starting at t
occupies [R·t + R - 1, R·(t + d)), after everything that ends at t and after every op
of no time at t; an op of no time at t occupies [R·t + k, R·t + k + 1) for a chosen
k < R - 1, and a dependency between two ops of no time at one instant orders their k.
Each rank's ops do not overlap on that axis, so their refined starts are the stream's
order; the hold [refined start F, refined end W) counts exactly what the stream holds
just after each F (a W of no time frees only if it comes before the F, which a chain of
ops of no time may forbid: issue 34). The model is exact, zero-cost stages included.
"""

from __future__ import annotations

import math

from schedules.analysis.accounting import held_peaks
from schedules.analysis.simulate import CostModel, simulate
from schedules.analysis.timeline import figures
from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import Instruction, Kind
from schedules.ir.schedule import Schedule, check_count, loop_placement, v_placement
from schedules.search.interleaved_zb import interleaved_zb
from schedules.search.zb_auto import zb_auto
from schedules.search.zb_optimal_model import SolvedSchedule, ZbOptimalModel
from schedules.search.zb_v_auto import zb_v_auto

__all__ = ["MAX_MICROBATCHES", "MAX_RANKS", "SolvedSchedule", "solve_zb_optimal", "zb_optimal"]

MAX_RANKS = 8
MAX_MICROBATCHES = 16


def zb_optimal(num_ranks: int, num_microbatches: int, chunks: int = 1, *,
               memory_limit: int | None = None, costs: CostModel | None = None,
               time_limit: float = 10.0) -> Schedule:
    """The schedule `solve_zb_optimal` finds (optimal when the solver proves it in time)."""
    return solve_zb_optimal(num_ranks, num_microbatches, chunks, memory_limit=memory_limit,
                            costs=costs, time_limit=time_limit).schedule


def _default_placement(p: int, v: int) -> tuple[int, ...]:
    return v_placement(p) if v == 2 else loop_placement(p, v)


def solve_zb_optimal(num_ranks: int, num_microbatches: int, chunks: int = 1, *,
                     memory_limit: int | None = None, costs: CostModel | None = None,
                     time_limit: float = 10.0,
                     placement: tuple[int, ...] | None = None,
                     start_from: Schedule | None = None) -> SolvedSchedule:
    """Minimum makespan for p <= 8 ranks and m <= 16 microbatches with split backwards.

    Placement: one stage per rank (v = 1), the V of ZB-V (v = 2) or a loop (v >= 3), or
    `placement` given. `memory_limit` K: (stage, microbatch) activations a rank may hold
    (default 2p, at least the most stages on one rank). Stops after `time_limit` seconds
    (the solver's deterministic time, about seconds: the same answer on every rank) with
    the best order found and the proven gap. `start_from`: a schedule to start from
    when it is faster than our heuristic (same placement and within the limit), so the
    result is never slower than it. Needs OR-Tools (`pip install ortools`).
    """
    p = check_count("num_ranks", num_ranks)
    m = check_count("num_microbatches", num_microbatches)
    v = check_count("chunks", chunks)
    if p > MAX_RANKS or m > MAX_MICROBATCHES:
        raise ScheduleConfigError(
            f"zb-optimal solves p <= {MAX_RANKS} and m <= {MAX_MICROBATCHES} (got p={p}, "
            f"m={m}): larger problems do not finish; use zb-auto or zb-v-auto")
    if isinstance(time_limit, bool) or not (isinstance(time_limit, int | float) and
                                            math.isfinite(time_limit) and time_limit > 0):
        raise ScheduleConfigError(f"time_limit must be seconds > 0, got {time_limit!r}")
    placement = placement or _default_placement(p, v)
    if sorted(set(placement)) != list(range(p)):
        raise ScheduleConfigError(f"placement {placement} must put stages on every rank "
                                  f"0..{p - 1} and on no other")
    most = max(placement.count(r) for r in range(p))
    limit = 2 * p if memory_limit is None else check_count(
        "memory_limit", memory_limit, minimum=most,
        hint=f" ((stage, microbatch) activations a rank may hold; the minimum is {most}, "
             "one microbatch through every stage of a rank)")
    limit = max(limit, most)  # the default 2p is below v for a loop of v > 2p chunks
    costs = costs or CostModel()
    try:
        from ortools.sat.python import cp_model
    except ImportError as error:
        raise ScheduleConfigError(
            "zb-optimal needs the OR-Tools CP-SAT solver, which is not installed; run "
            "pip install ortools (or pip install -e '.[solver]' from a clone)") from error
    hint_name, hint = _heuristic(p, m, placement, limit, costs)
    hint_makespan = figures(simulate(hint, costs)).makespan
    if start_from is not None and start_from.placement == placement and \
            start_from.num_microbatches == m:
        given = Schedule(start_from.name, m, placement, _split(start_from.compute_streams()))
        found = figures(simulate(given, costs))
        if max(held_peaks(given)) <= limit and found.makespan < hint_makespan:
            hint_name, hint, hint_makespan = start_from.name, given, found.makespan
    return ZbOptimalModel(cp_model, placement, m, limit, costs).solve(
        hint, hint_name, hint_makespan, time_limit)


def _heuristic(p: int, m: int, placement: tuple[int, ...], limit: int,
               costs: CostModel) -> tuple[str, Schedule]:
    """The best cost-aware heuristic for this placement: the solver's starting point."""
    v = len(placement) // p
    if placement == loop_placement(p, 1):
        return "zb-auto", zb_auto(p, m, memory_limit=limit, costs=costs)
    if placement == v_placement(p):
        return "zb-v-auto", zb_v_auto(p, m, memory_limit=limit, costs=costs)
    if placement == loop_placement(p, v):
        return "interleaved-zb", interleaved_zb(p, m, v, memory_limit=limit, costs=costs)
    raise ScheduleConfigError(f"zb-optimal knows no heuristic to start from for placement "
                              f"{placement}; use one stage per rank, the V, or a loop")


def _split(streams: tuple[tuple[Instruction, ...], ...]) -> tuple[tuple[Instruction, ...], ...]:
    """Each fused or overlapped backward as I then W at once (the model knows F, I, W)."""
    return tuple(tuple(x for op in stream for x in (
        (Instruction(Kind.I, op.stage, op.microbatch), Instruction(Kind.W, op.stage,
                                                                    op.microbatch))
        if op.kind in (Kind.B, Kind.OVERLAP_B) else (op,))) for stream in streams)
