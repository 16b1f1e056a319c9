"""The `balanced` method: pick the exact solver that fits the cost model, and the memory floor."""

from __future__ import annotations

import numpy as np

from partition.bisection import solve_monotone
from partition.dag import DagCosts, solve_dag
from partition.errors import InfeasibleMemoryError
from partition.parametric import ChainCosts, solve_chain
from partition.stage_costs import StageCosts

__all__ = ["minimum_memory_cap", "solve_balanced"]

# Three exact solvers, cheapest first:
#   bisection.solve_monotone  chain, no communication, equal speeds, the same memory rule
#                             for every stage: greedy probe + exact bisection, O(p log n)
#                             per probe (n = 100,000, p = 128 in well under a second).
#   parametric.solve_chain    any chain: stage-dependent speeds and memory (1F1B), per-cut
#                             communication: reachable-set probe, O(p n) per probe.
#   dag.solve_dag             a DAG with skip edges: O(p n^2) dynamic program.


def solve_balanced(model: StageCosts) -> tuple[int, ...]:
    """Boundaries minimising the slowest stage's compute + comm time under the memory cap;
    raises `InfeasibleMemoryError` (with the smallest workable cap) if none fits."""
    capped = model.memory_cap is not None
    solution: tuple[tuple[int, ...], float] | None
    if (
        not model.has_comm
        and model.uniform_speed
        and (not capped or model.memory_is_stage_independent)
    ):
        monotone = solve_monotone(
            model.compute.full(0),
            model.num_stages,
            memory_prefix=model.memory.full(0) if capped else None,
            memory_cap=model.memory_cap,
        )
        solution = None if monotone is None else (monotone.boundaries, monotone.bottleneck)
    elif model.is_chain or not model.has_comm:
        # Without communication a DAG's stage time depends only on its layers: a chain.
        solution = solve_chain(
            ChainCosts(
                compute=model.compute,
                cut=model.cut_seconds() if model.is_chain else np.zeros(model.num_layers + 1),
                memory=model.memory if capped else None,
                memory_cap=model.memory_cap,
                balance_prefix=model.compute_prefix,
                balance_shares=model.speeds,
            )
        )
    else:
        solution = solve_dag(
            DagCosts(
                num_layers=model.num_layers,
                compute=model.compute,
                edge_source=model.edge_source,
                edge_target=model.edge_target,
                edge_seconds=model.edge_seconds,
                memory=model.memory if capped else None,
                memory_cap=model.memory_cap,
                balance_prefix=model.compute_prefix,
                balance_shares=model.speeds,
            )
        )
    if solution is None:
        cap = model.memory_cap if model.memory_cap is not None else float("inf")
        raise InfeasibleMemoryError(cap, minimum_memory_cap(model), model.num_stages)
    return solution[0]


def minimum_memory_cap(model: StageCosts) -> float:
    """The smallest per-stage memory cap any p-stage partition fits under: the min-max
    partition with memory as the cost (exact, by the same solvers)."""
    if model.memory_is_stage_independent:
        monotone = solve_monotone(model.memory.full(0), model.num_stages)
        if monotone is None:
            raise RuntimeError("internal error: an uncapped partition is always feasible")
        return monotone.bottleneck
    solution = solve_chain(ChainCosts(compute=model.memory, cut=np.zeros(model.num_layers + 1)))
    if solution is None:
        raise RuntimeError("internal error: an uncapped partition is always feasible")
    return solution[1]
