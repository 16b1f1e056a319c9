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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from schedules.analysis.simulate import CostModel, simulate
from schedules.analysis.timeline import figures
from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import NONE, Instruction, Kind
from schedules.ir.schedule import Schedule, check_count, loop_placement, v_placement
from schedules.search.interleaved_zb import interleaved_zb
from schedules.search.zb_auto import zb_auto
from schedules.search.zb_v_auto import zb_v_auto

__all__ = ["MAX_MICROBATCHES", "MAX_RANKS", "OptimalPlan", "solve_zb_optimal", "zb_optimal"]

MAX_RANKS = 8
MAX_MICROBATCHES = 16
_KINDS = (Kind.F, Kind.I, Kind.W)


@dataclass(frozen=True)
class OptimalPlan:
    """The solver's schedule, its simulated makespan and the proven lower bound."""

    schedule: Schedule
    makespan: float
    bound: float
    """No order under the memory limit finishes before this (the solver's proof)."""
    proven: bool
    """True when the solver closed the gap: `makespan` is the optimum."""
    heuristic: str
    """The heuristic schedule the solver started from."""

    @property
    def gap(self) -> float:
        """(makespan - bound) / makespan: 0 when proven optimal."""
        return 0.0 if self.proven or self.makespan <= 0 else max(
            0.0, (self.makespan - self.bound) / self.makespan)


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
                     start_from: Schedule | None = None) -> OptimalPlan:
    """Minimum makespan for p <= 8 ranks and m <= 16 microbatches with split backwards.

    Placement: one stage per rank (v = 1), the V of ZB-V (v = 2) or a loop (v >= 3), or
    `placement` given. `memory_limit` K: (stage, microbatch) activations a rank may hold
    (default 2p, at least the most stages on one rank). Stops after `time_limit` seconds
    (the solver's deterministic time, about seconds: the same answer on every rank) with
    the best order found and the proven gap. `start_from`: a schedule to start from
    when it is faster than our heuristic (same placement and within the limit), so the
    result is never slower than it. Needs OR-Tools (`pip install 'pipesched[solver]'`).
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
            "pip install 'pipesched[solver]' (or pip install ortools)") from error
    hint_name, hint = _heuristic(p, m, placement, limit, costs)
    hint_makespan = figures(simulate(hint, costs)).makespan
    if start_from is not None and start_from.placement == placement and \
            start_from.num_microbatches == m:
        given = Schedule(start_from.name, m, placement, _split(start_from.compute_streams()))
        found = figures(simulate(given, costs))
        if max(found.peak_activations) <= limit and found.makespan < hint_makespan:
            hint_name, hint, hint_makespan = start_from.name, given, found.makespan
    return _Model(cp_model, placement, m, limit, costs).solve(
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


def _renamed(schedule: Schedule) -> Schedule:
    return Schedule("zb-optimal", schedule.num_microbatches, schedule.placement,
                    schedule.streams)


def _scale(values: list[float]) -> int:
    """Smallest integer that makes every value (as a fraction of denominator <= 1000) whole."""
    scale = 1
    for x in values:
        scale = math.lcm(scale, Fraction(x).limit_denominator(1000).denominator)
    if scale > 10_000:
        raise ScheduleConfigError(f"costs {sorted(set(values))[:6]} need a time unit of "
                                  f"1/{scale}; round them to multiples of 0.01")
    return scale


class _Model:
    def __init__(self, cp_model: Any, placement: tuple[int, ...], m: int, limit: int,
                 costs: CostModel) -> None:
        self.cp_model, self.placement, self.m, self.limit = cp_model, placement, m, limit
        self.costs = costs
        self.num_stages = len(placement)
        forward, backward, weight, delay, _ = costs.resolve(self.num_stages)
        self.scale = _scale(forward + backward + weight + delay)

        def whole(values: list[float]) -> list[int]:
            return [round(Fraction(x).limit_denominator(1000) * self.scale) for x in values]

        self.duration = {Kind.F: whole(forward), Kind.I: whole(backward),
                         Kind.W: whole(weight)}
        self.delay = whole(delay)

    def solve(self, hint: Schedule, hint_name: str, hint_makespan: float,
              time_limit: float) -> OptimalPlan:
        cp, S, m, placement = self.cp_model, self.num_stages, self.m, self.placement
        model = cp.CpModel()
        horizon = math.ceil(hint_makespan * self.scale) + 1
        start: dict[tuple[Kind, int, int], Any] = {}
        end: dict[tuple[Kind, int, int], Any] = {}
        by_rank: list[list[Any]] = [[] for _ in range(1 + max(placement))]
        for kind in _KINDS:
            for s in range(S):
                for i in range(m):
                    key, size = (kind, s, i), self.duration[kind][s]
                    start[key] = model.NewIntVar(0, horizon, f"start_{kind.value}{s}_{i}")
                    end[key] = model.NewIntVar(0, horizon, f"end_{kind.value}{s}_{i}")
                    by_rank[placement[s]].append(
                        model.NewIntervalVar(start[key], size, end[key], f"op_{key}"))
        for s in range(S):
            for i in range(m):
                cross = self.delay[s] if s + 1 < S and placement[s + 1] != placement[s] else 0
                if s + 1 < S:
                    model.Add(start[Kind.F, s + 1, i] >= end[Kind.F, s, i] + cross)
                    model.Add(start[Kind.I, s, i] >= end[Kind.I, s + 1, i] + cross)
                model.Add(start[Kind.I, s, i] >= end[Kind.F, s, i])
                model.Add(start[Kind.W, s, i] >= end[Kind.I, s, i])
                if i + 1 < m:  # microbatch order within a stage
                    for kind in _KINDS:
                        model.Add(start[kind, s, i + 1] >= end[kind, s, i])
        held: list[list[Any]] = [[] for _ in by_rank]
        sizes: dict[tuple[int, int], Any] = {}
        for s in range(S):
            for i in range(m):
                size = sizes[s, i] = model.NewIntVar(0, horizon, f"held{s}_{i}")
                held[placement[s]].append(model.NewIntervalVar(
                    start[Kind.F, s, i], size, end[Kind.W, s, i], f"held_{s}_{i}"))
        for rank_ops, rank_held in zip(by_rank, held):
            model.AddNoOverlap(rank_ops)
            model.AddCumulative(rank_held, [1] * len(rank_held), self.limit)
        makespan = model.NewIntVar(0, horizon, "makespan")
        model.AddMaxEquality(makespan, [end[Kind.W, s, i] for s in range(S) for i in range(m)])
        # Redundant, for the bound: a rank cannot start before microbatch 0's forward
        # reaches its lowest stage, and then has all of its work to do.
        reach, self.simple_bound = 0, 0.0
        for s in range(S):
            rank = placement[s]
            if s == min(t for t in range(S) if placement[t] == rank):
                work = sum(self.duration[k][t] * m for k in _KINDS for t in range(S)
                           if placement[t] == rank)
                model.Add(makespan >= reach + work)
                self.simple_bound = max(self.simple_bound, (reach + work) / self.scale)
            reach += self.duration[Kind.F][s] + (
                self.delay[s] if s + 1 < S and placement[s + 1] != rank else 0)
        model.Minimize(makespan)
        self._hint(model, hint, start, end, sizes, makespan)
        solver = cp.CpSolver()
        # Deterministic: one worker, a fixed seed and a limit in the solver's deterministic
        # time (about seconds on one quiet core), so every rank that builds this schedule
        # gets the same order (the engine refuses ranks that disagree). Wall time is only a
        # safety net, generous enough for a loaded machine.
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = 0
        solver.parameters.max_deterministic_time = float(time_limit)
        solver.parameters.max_time_in_seconds = 10.0 * float(time_limit)
        # Probing expands unit-length no-overlaps into all-different clauses (seconds at
        # p = 4, m = 8) before any search; the bound comes from the search instead.
        solver.parameters.cp_model_probing_level = 0
        status = solver.Solve(model)
        bound = max(solver.BestObjectiveBound() / self.scale, self.simple_bound)
        if status not in (cp.OPTIMAL, cp.FEASIBLE):
            return OptimalPlan(_renamed(hint), hint_makespan,
                               min(bound, hint_makespan), False, hint_name)
        schedule = self._order(solver, start, end)
        found = figures(simulate(schedule, self.costs)).makespan
        if found > hint_makespan:  # re-simulated, the solver's order can only be faster
            schedule, found = _renamed(hint), hint_makespan
        proven = status == cp.OPTIMAL
        return OptimalPlan(schedule, found, found if proven else min(bound, found), proven,
                           hint_name)

    def _hint(self, model: Any, hint: Schedule, start: dict[tuple[Kind, int, int], Any],
              end: dict[tuple[Kind, int, int], Any], sizes: dict[tuple[int, int], Any],
              makespan: Any) -> None:
        """Every variable at the heuristic's value, so the solver starts from a solution."""
        timeline = simulate(hint, self.costs)
        at: dict[tuple[Kind, int, int], int] = {}
        for span in timeline.spans():
            key = (span.kind, span.stage, span.microbatch)
            at[key] = round(span.start * self.scale)
        for key, var in start.items():
            model.AddHint(var, at[key])
            model.AddHint(end[key], at[key] + self.duration[key[0]][key[1]])
        for (s, i), var in sizes.items():
            model.AddHint(var, at[Kind.W, s, i] + self.duration[Kind.W][s] - at[Kind.F, s, i])
        model.AddHint(makespan, max(at[Kind.W, s, i] + self.duration[Kind.W][s]
                                    for s, i in sizes))

    def _order(self, solver: Any, start: dict[tuple[Kind, int, int], Any],
               end: dict[tuple[Kind, int, int], Any]) -> Schedule:
        # Each rank's ops by start time; equal starts (zero-length ops) in dependency
        # order: F down the stages, then I up the stages, then W.
        rows: list[list[tuple[int, int, int, int, int, Instruction]]] = [
            [] for _ in range(1 + max(self.placement))]
        rank_of = {Kind.F: 0, Kind.I: 1, Kind.W: 2}
        for (kind, s, i), var in start.items():
            tie = s if kind is not Kind.I else -s
            rows[self.placement[s]].append((solver.Value(var), solver.Value(end[kind, s, i]),
                                            rank_of[kind], tie, i,
                                            Instruction(kind, s, i, NONE)))
        streams = tuple(tuple(row[-1] for row in sorted(rank_rows, key=lambda r: r[:5]))
                        for rank_rows in rows)
        return Schedule("zb-optimal", self.m, self.placement, streams)
