"""zb-optimal's CP-SAT model (stated in `zb_optimal`'s docstring) and its solve."""

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
from schedules.ir.schedule import Schedule

__all__ = ["SolvedSchedule", "ZbOptimalModel"]

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


class ZbOptimalModel:
    """One solve's CP-SAT model over a placement, m, a memory limit and the costs."""

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
