"""zb-optimal on zero-length dependency chains: never over the limit, never a false "proven".

Regression for issue 34, item 1. When ops take no time, a chain of them runs at one
instant, yet in dependency order: at p = 2, m = 2 on the V with K = 2, F = [3, 3, 3, 0],
B = 0, W = [0, 0, 0, 2], F(3, j) must run before W(0, j) (through I(3..0, j), all of no
time), so W(0, j)'s free cannot make room for F(3, j). The model let it and "proved" 17;
the truth within K is 20.

The oracle below is written from the definition, not from zb-optimal's model: one global
order of every op (a position each, all different), each rank running its ops in that
order (an op starts after the rank's previous op ends), every dependency before its
dependant in the order and in time (plus the delay across ranks), and at most K
activations held on a rank just after each of its F's (F takes one; W, which ends its
stage-microbatch, frees it). It does not restrict microbatch order. Asked with CP-SAT
whether any such order finishes by a horizon (integer costs: exact), it checks that none
finishes before zb-optimal's bound, which "proven" sets to its makespan.
"""

from __future__ import annotations

import importlib.util
import math
import random
from typing import Any

import pytest

from schedules import CostModel, figures, simulate, solve_zb_optimal, v_placement, validate
from schedules.analysis.accounting import held_peaks

__all__: list[str] = []

# a skip without importing: ortools' CP-SAT module imports pandas, seconds of collection
pytestmark = pytest.mark.skipif(importlib.util.find_spec("ortools") is None,
                                reason="zb-optimal needs the 'solver' extra")


def oracle_finishes_by(placement: tuple[int, ...], m: int, limit: int, forward: list[int],
                       backward: list[int], weight: list[int], comm: int,
                       horizon: int) -> bool:
    """True if some per-rank order of the split F, I, W ops within `limit` finishes by
    `horizon` (a feasibility question: far cheaper for CP-SAT than the optimum)."""
    if horizon < 0:
        return False
    S = len(placement)
    duration = {"F": forward, "I": backward, "W": weight}
    ops = [(kind, s, i) for kind in "FIW" for s in range(S) for i in range(m)]
    needs: dict[tuple[str, int, int], list[tuple[str, int, int]]] = {op: [] for op in ops}
    for s in range(S):
        for i in range(m):
            if s:
                needs["F", s, i].append(("F", s - 1, i))
            needs["I", s, i].append(("F", s, i))
            if s + 1 < S:
                needs["I", s, i].append(("I", s + 1, i))
            needs["W", s, i].append(("I", s, i))
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    start = {op: model.NewIntVar(0, horizon - duration[op[0]][op[1]], f"s{op}") for op in ops}
    position = {op: model.NewIntVar(0, len(ops) - 1, f"p{op}") for op in ops}
    model.AddAllDifferent(list(position.values()))  # one global order of every op

    def end(op: tuple[str, int, int]) -> Any:
        return start[op] + duration[op[0]][op[1]]

    for op, deps in needs.items():
        for dep in deps:
            delay = comm if placement[dep[1]] != placement[op[1]] else 0
            model.Add(start[op] >= end(dep) + delay)
            model.Add(position[op] > position[dep])
    rank_ops = [[op for op in ops if placement[op[1]] == r] for r in range(max(placement) + 1)]
    before: dict[tuple[Any, Any], Any] = {}
    for group in rank_ops:
        for a in group:
            for b in group:
                if a < b:  # the rank runs a then b, or b then a: in order and in time
                    first = model.NewBoolVar(f"{a}<{b}")
                    model.Add(position[a] < position[b]).OnlyEnforceIf(first)
                    model.Add(position[a] > position[b]).OnlyEnforceIf(first.Not())
                    model.Add(start[b] >= end(a)).OnlyEnforceIf(first)
                    model.Add(start[a] >= end(b)).OnlyEnforceIf(first.Not())
                    before[a, b], before[b, a] = first, first.Not()
        for f in (op for op in group if op[0] == "F"):  # held just after each F
            taken = [before[g, f] for g in group if g[0] == "F" and g != f]
            freed = [before[w, f] for w in group if w[0] == "W"]
            model.Add(1 + sum(taken) - sum(freed) <= limit)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 60.0
    status = solver.Solve(model)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE, cp_model.INFEASIBLE)
    return bool(status != cp_model.INFEASIBLE)


def _check(placement: tuple[int, ...], m: int, limit: int, forward: list[int],
           backward: list[int], weight: list[int], comm: int = 0) -> tuple[float, bool]:
    """zb-optimal's (makespan, proven), after checking its order against the definition:
    valid, within the limit as the stream holds it, and no order within the limit
    finishing before its bound (so before its makespan when it says "proven")."""
    p = max(placement) + 1
    costs = CostModel(forward=forward, backward=backward, weight=weight, comm=comm)
    plan = solve_zb_optimal(p, m, len(placement) // p, memory_limit=limit, costs=costs,
                            placement=placement, time_limit=10)
    validate(plan.schedule)
    assert max(held_peaks(plan.schedule)) <= limit, plan.schedule.format()
    assert max(figures(simulate(plan.schedule, costs)).peak_activations) <= limit
    assert plan.makespan == pytest.approx(figures(simulate(plan.schedule, costs)).makespan)
    # integer costs: "nothing finishes before the bound" is "nothing by ceil(bound) - 1"
    below = math.ceil(plan.bound - 1e-9) - 1
    assert not oracle_finishes_by(placement, m, limit, forward, backward, weight, comm,
                                  below), f"an order within {limit} finishes by {below}"
    if plan.proven:
        assert plan.bound == pytest.approx(plan.makespan)
    return plan.makespan, plan.proven


@pytest.mark.parametrize(("forward", "truth"), [([3, 3, 3, 0], 20), ([3, 1, 2, 0], 14)])
def test_a_zero_length_chain_cannot_free_before_it_takes(forward: list[int],
                                                         truth: int) -> None:
    case = (v_placement(2), 2, 2, forward, [0, 0, 0, 0], [0, 0, 0, 2], 0)
    # the oracle's truth: an order finishes by `truth`, none by `truth - 1`
    assert oracle_finishes_by(*case, truth) and not oracle_finishes_by(*case, truth - 1)
    assert _check(*case) == (truth, True)


def _zero_chain_case(rng: random.Random) -> tuple[tuple[int, ...], int, int, list[int],
                                                   list[int], list[int], int]:
    """p = 2, m = 2, V or one stage per rank, most costs 0 so that chains of ops take no
    time; the limit at the placement's minimum or one above."""
    placement = v_placement(2) if rng.random() < 0.75 else (0, 1)
    S = len(placement)

    def costs() -> list[int]:
        return [rng.choice([0, 0, 0, 1, 2, 3]) for _ in range(S)]

    minimum = S // 2
    return (placement, 2, rng.choice([minimum, minimum + 1]), costs(), costs(), costs(),
            rng.choice([0, 0, 0, 1]))


def _sweep(count: int, seed: int) -> None:
    rng = random.Random(seed)
    proven = 0
    for _ in range(count):
        _, was_proven = _check(*_zero_chain_case(rng))
        proven += was_proven
    assert proven >= count * 0.9  # the exact model proves nearly all of these small cases


def test_zero_length_chains_a_quick_sweep() -> None:
    _sweep(25, seed=1)


@pytest.mark.slow
def test_zero_length_chains_sweep_of_400() -> None:
    _sweep(400, seed=34)
