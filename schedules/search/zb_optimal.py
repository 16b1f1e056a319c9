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
to integers without loss when the common denominator is small enough (`_EXACT_SCALE`);
then `proven` means optimal for the given costs. Otherwise they are rounded to a time unit
of at most 1/10000: the solver's proof holds for the rounded costs only
(`optimal_for_rounded_costs`), `proven` stays False and `bound` is the rounded bound minus
the most rounding any chain of ops can accumulate, a bound for the true costs.
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
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from schedules.analysis.accounting import held_peaks
from schedules.analysis.simulate import CostModel, simulate
from schedules.analysis.timeline import figures
from schedules.ir.errors import ScheduleConfigError
from schedules.ir.instructions import NONE, Instruction, Kind
from schedules.ir.schedule import Schedule, check_count, loop_placement, v_placement
from schedules.search.interleaved_zb import interleaved_zb
from schedules.search.zb_auto import zb_auto
from schedules.search.zb_v_auto import zb_v_auto

__all__ = ["MAX_MICROBATCHES", "MAX_RANKS", "SolvedSchedule", "solve_zb_optimal", "zb_optimal"]

MAX_RANKS = 8
MAX_MICROBATCHES = 16
_EXACT_SCALE = 10**6  # largest common denominator solved without rounding
_KINDS = (Kind.F, Kind.I, Kind.W)
_Op = tuple[Kind, int, int]  # (kind, stage, microbatch)


@dataclass(frozen=True)
class SolvedSchedule:
    """The solver's schedule, its simulated makespan and the proven lower bound."""

    schedule: Schedule
    makespan: float
    bound: float
    """No order under the memory limit finishes before this (the solver's proof)."""
    proven: bool
    """True when the solver closed the gap: `makespan` is the optimum."""
    heuristic: str
    """The heuristic schedule the solver started from."""
    kept_heuristic: str | None = None
    """Why the heuristic's order was returned instead of the solver's: "no solution" in
    the time limit, "slower" once re-simulated, or "over the memory limit" (a tie the
    stream order could not realise); None when the order is the solver's."""
    optimal_for_rounded_costs: bool = False
    """True when the costs had to be rounded (see the module) and the solver proved the
    order optimal for the rounded costs; `proven` is then False and `bound` is for the
    true costs."""

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


def _scale(values: list[float]) -> tuple[int, list[Fraction]]:
    """The time unit 1/scale and each value in it: exact (each value as the decimal it
    prints as) when the common denominator is at most `_EXACT_SCALE`, else each value
    rounded to a fraction of denominator <= 1000."""
    exact = [Fraction(repr(float(x))) for x in values]
    scale = 1
    for x in exact:
        scale = math.lcm(scale, x.denominator)
    if scale <= _EXACT_SCALE:
        return scale, exact
    rounded = [Fraction(x).limit_denominator(1000) for x in values]
    scale = 1
    for x in rounded:
        scale = math.lcm(scale, x.denominator)
    if scale > 10_000:
        raise ScheduleConfigError(f"costs {sorted(set(values))[:6]} need a time unit of "
                                  f"1/{scale}; round them to multiples of 0.01")
    return scale, rounded


class _Model:
    def __init__(self, cp_model: Any, placement: tuple[int, ...], m: int, limit: int,
                 costs: CostModel) -> None:
        self.cp_model, self.placement, self.m, self.limit = cp_model, placement, m, limit
        self.costs = costs
        self.num_stages = len(placement)
        forward, backward, weight, delay, _ = costs.resolve(self.num_stages)
        values = forward + backward + weight + delay
        self.scale, fractions = _scale(values)
        whole = [round(x * self.scale) for x in fractions]
        S = self.num_stages
        self.duration = {Kind.F: whole[:S], Kind.I: whole[S:2 * S], Kind.W: whole[2 * S:3 * S]}
        self.delay = whole[3 * S:]
        errors = [abs(float(x) - y) for x, y in zip(fractions, values)]
        self.exact = all(x == Fraction(repr(float(y))) for x, y in zip(fractions, values))
        # The most rounding a chain of ops (each op and each delay at most once per op)
        # can gather: 3Sm ops, each followed by at most one delay.
        self.slack = 0.0 if self.exact else 3 * S * m * (max(errors[:3 * S]) + max(
            errors[3 * S:], default=0.0))
        # the refined axis (see the module): R ticks per time unit, R - 1 places at an
        # instant for ops of no time, one more for the op of some length that starts there
        zero_ops = sum(m for kind in _KINDS for s in range(S) if self.duration[kind][s] == 0)
        self.refine = zero_ops + 2 if zero_ops else 1
        # per op: its start, its end (start + length) and its refined start (tick), CP-SAT
        # variables or expressions; `place` for ops of no time, their place at the instant
        self.start: dict[_Op, Any] = {}
        self.end: dict[_Op, Any] = {}
        self.tick: dict[_Op, Any] = {}
        self.place: dict[_Op, Any] = {}

    def _precede(self, model: Any, before: _Op, after: _Op, delay: int = 0) -> None:
        """`after` starts once `before` ended (plus `delay`), and after it on the refined axis."""
        model.Add(self.start[after] >= self.end[before] + delay)
        if not self.duration[before[0]][before[1]] and not self.duration[after[0]][after[1]]:
            model.Add(self.tick[after] >= self.tick[before] + 1)  # both at one instant

    def solve(self, hint: Schedule, hint_name: str, hint_makespan: float,
              time_limit: float) -> SolvedSchedule:
        cp, S, m, placement, R = self.cp_model, self.num_stages, self.m, self.placement, \
            self.refine
        model = cp.CpModel()
        horizon = math.ceil((hint_makespan + self.slack) * self.scale) + 1
        refined_end: dict[_Op, Any] = {}
        by_rank: list[list[Any]] = [[] for _ in range(1 + max(placement))]
        for kind in _KINDS:
            for s in range(S):
                for i in range(m):
                    key, size = (kind, s, i), self.duration[kind][s]
                    name = f"{kind.value}{s}_{i}"
                    start = self.start[key] = model.NewIntVar(0, horizon, f"start_{name}")
                    self.end[key] = start + size
                    if size:  # [R·t + R - 1, R·(t + d)): after every op of no time at t
                        self.tick[key] = R * start + (R - 1)
                        refined_end[key] = R * (start + size)
                        length = R * size - R + 1
                    else:  # one of the R - 1 places of the instant
                        place = self.place[key] = model.NewIntVar(0, R - 2, f"place_{name}")
                        tick = self.tick[key] = model.NewIntVar(0, R * (horizon + 1),
                                                                f"tick_{name}")
                        model.Add(tick == R * start + place)
                        refined_end[key] = self.tick[key] + 1
                        length = 1
                    by_rank[placement[s]].append(model.NewFixedSizeIntervalVar(
                        self.tick[key], length, f"op_{name}"))
        for s in range(S):
            for i in range(m):
                cross = self.delay[s] if s + 1 < S and placement[s + 1] != placement[s] else 0
                if s + 1 < S:
                    self._precede(model, (Kind.F, s, i), (Kind.F, s + 1, i), cross)
                    self._precede(model, (Kind.I, s + 1, i), (Kind.I, s, i), cross)
                self._precede(model, (Kind.F, s, i), (Kind.I, s, i))
                self._precede(model, (Kind.I, s, i), (Kind.W, s, i))
                if i + 1 < m:  # microbatch order within a stage
                    for kind in _KINDS:
                        self._precede(model, (kind, s, i), (kind, s, i + 1))
        held: list[list[Any]] = [[] for _ in by_rank]
        for s in range(S):
            for i in range(m):
                taken, freed = self.tick[Kind.F, s, i], refined_end[Kind.W, s, i]
                size = model.NewIntVar(1, R * (horizon + 1), f"held{s}_{i}")
                held[placement[s]].append(model.NewIntervalVar(taken, size, freed,
                                                               f"held_{s}_{i}"))
        for rank_ops, rank_held in zip(by_rank, held):
            model.AddNoOverlap(rank_ops)
            model.AddCumulative(rank_held, [1] * len(rank_held), self.limit)
        makespan = model.NewIntVar(0, horizon, "makespan")
        model.AddMaxEquality(makespan, [self.end[Kind.W, s, i] for s in range(S)
                                        for i in range(m)])
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
        self._hint(model, hint, makespan)
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
        simple = self.simple_bound - self.slack
        # The solver's bound is one for the true costs when the model is exact (no
        # rounding), else less the slack.
        bound = max(solver.BestObjectiveBound() / self.scale - self.slack, simple)
        if status not in (cp.OPTIMAL, cp.FEASIBLE):
            return SolvedSchedule(_renamed(hint), hint_makespan,
                                  min(bound, hint_makespan), False, hint_name,
                                  kept_heuristic="no solution")
        schedule = self._order(solver)
        found = figures(simulate(schedule, self.costs))
        # Re-simulated, the solver's order can only be faster and within the limit (its
        # memory is the order's, `held_peaks`); keep the heuristic if rounding says otherwise.
        kept = "over the memory limit" if max(held_peaks(schedule)) > self.limit else \
            "slower" if found.makespan > hint_makespan else None
        if kept:
            schedule, makespan = _renamed(hint), hint_makespan
        else:
            makespan = found.makespan
        # A proof covers the order returned only if that order, re-simulated, takes the
        # solver's optimum: a model that misses a delay or a dependency fails this.
        optimal = status == cp.OPTIMAL
        proven = (optimal and self.exact and math.isclose(
            makespan, solver.ObjectiveValue() / self.scale, rel_tol=1e-9, abs_tol=1e-9)) or \
            makespan <= max(simple, 0.0) + 1e-12
        return SolvedSchedule(schedule, makespan, makespan if proven else min(bound, makespan),
                              proven, hint_name, kept_heuristic=kept,
                              optimal_for_rounded_costs=optimal and not self.exact)

    def _hint(self, model: Any, hint: Schedule, makespan: Any) -> None:
        """Every variable at the heuristic's value, so the solver starts from a solution:
        its simulated starts, and for ops of no time at one instant, their places in one
        order of the whole schedule that keeps every stream's order and every dependency."""
        run = simulate(hint, self.costs)
        at: dict[_Op, int] = {}
        for span in run.spans():
            at[span.kind, span.stage, span.microbatch] = round(span.start * self.scale)
        for key, var in self.start.items():
            model.AddHint(var, at[key])
        places: dict[int, int] = {}
        for key in _global_order(hint):
            if not self.duration[key[0]][key[1]]:
                place = places.get(at[key], 0)
                places[at[key]] = place + 1
                model.AddHint(self.place[key], place)
        model.AddHint(makespan, max(at[Kind.W, s, i] + self.duration[Kind.W][s]
                                    for s in range(self.num_stages) for i in range(self.m)))

    def _order(self, solver: Any) -> Schedule:
        """Each rank's ops by their refined start: their order in the solver's solution
        (distinct on a rank: its ops do not overlap on the refined axis)."""
        ticks = sorted(self.tick, key=lambda key: solver.Value(self.tick[key]))
        streams: list[list[Instruction]] = [[] for _ in range(1 + max(self.placement))]
        for kind, s, i in ticks:
            streams[self.placement[s]].append(Instruction(kind, s, i, NONE))
        return Schedule("zb-optimal", self.m, self.placement, tuple(map(tuple, streams)))


def _global_order(schedule: Schedule) -> list[_Op]:
    """One order of every op of `schedule` that keeps each rank's stream order and puts
    every dependency first (Kahn's algorithm; the streams run, so there is one)."""
    streams = [[(op.kind, op.stage, op.microbatch) for op in stream]
               for stream in schedule.streams]
    done: set[_Op] = set()
    heads = [0] * len(streams)
    order: list[_Op] = []
    last = schedule.num_stages - 1
    progress = True
    while progress:
        progress = False
        for rank, stream in enumerate(streams):
            while heads[rank] < len(stream):
                kind, s, i = stream[heads[rank]]
                if kind is Kind.F:
                    needs = [(Kind.F, s - 1, i)] if s else []
                elif kind is Kind.W:
                    needs = [(Kind.I, s, i)]
                else:
                    needs = [(Kind.F, s, i)] + ([(Kind.I, s + 1, i)] if s < last else [])
                if any(need not in done for need in needs):
                    break
                done.add((kind, s, i))
                order.append((kind, s, i))
                heads[rank] += 1
                progress = True
    return order
