"""Hypothesis properties: every balanced partition equals a brute-force optimum (no torch)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partition import (
    InfeasibleMemoryError,
    LayerCost,
    ModelGraph,
    ScheduleMemory,
    partition_graph,
    partition_weights,
)
from partition.bisection import solve_monotone
from partition.dag import DagCosts, solve_dag
from partition.parametric import ChainCosts, solve_chain
from partition.prefix_sums import LinearPrefix

__all__: list[str] = []

OPTIMIZER = 3.0


def naive_costs(
    graph: ModelGraph,
    boundaries: Sequence[int],
    speeds: Sequence[float],
    inflight: Sequence[int],
    bandwidth: float | None,
) -> tuple[list[float], list[float], list[float]]:
    """Per-stage (compute, comm, memory) straight from the definitions, one layer at a time."""
    p = len(boundaries) - 1
    stage = {i: k for k in range(p) for i in range(boundaries[k], boundaries[k + 1])}
    compute, comm, memory = [0.0] * p, [0.0] * p, [0.0] * p
    for index, layer in enumerate(graph.layers):
        k = stage[index]
        compute[k] += layer.compute / speeds[k]
        memory[k] += layer.params * (1 + OPTIMIZER) + layer.extra_memory
        memory[k] += inflight[k] * layer.activation
    if bandwidth:
        for edge in graph.edges:
            if stage[edge.source] != stage[edge.target]:
                comm[stage[edge.source]] += edge.bytes / bandwidth
                comm[stage[edge.target]] += edge.bytes / bandwidth
    return compute, comm, memory


def all_boundaries(n: int, p: int) -> list[tuple[int, ...]]:
    """Every way to cut n layers into p contiguous non-empty stages."""
    return [(0, *cuts, n) for cuts in itertools.combinations(range(1, n), p - 1)]


def inflight_of(schedule: ScheduleMemory, p: int, m: int | None) -> list[int]:
    m = p if m is None else m
    if schedule is ScheduleMemory.GPIPE:
        return [m] * p
    return [min(p - k, m) for k in range(p)]


def close(a: float, b: float, scale: float = 1.0) -> bool:
    """Equal up to rounding; ``scale`` is the problem's total, since prefix sums lose
    absolute precision in proportion to it."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12 * max(scale, 1.0))


@st.composite
def problems(draw: st.DrawFn, dag: bool = False, extreme: bool = False) -> dict:
    """A small random graph and partition options; ``extreme`` mixes times from 1e-9 s
    to 1e9 s."""
    n = draw(st.integers(1, 9 if dag else 10))
    p = draw(st.integers(1, min(n, 5)))
    integral = draw(st.booleans())  # integer costs make many ties
    time = st.integers(0, 6).map(float) if integral else st.floats(0, 10)
    if extreme:
        time = st.builds(lambda x, e: x * 10.0**e, st.floats(0, 1), st.integers(-9, 9))
    layers = [
        LayerCost(
            f"l{i}",
            forward=draw(time),
            backward=draw(time),
            params=float(draw(st.integers(0, 1000))),
            activation=float(draw(st.integers(0, 500))),
            extra_memory=float(draw(st.sampled_from([0, 0, 100]))),
        )
        for i in range(n)
    ]
    edges = [(i, i + 1, layers[i].activation) for i in range(n - 1)]
    if dag:
        pairs = [(u, v) for u in range(n) for v in range(u + 2, n)]
        chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=6)) if pairs else []
        edges += [(u, v, float(draw(st.integers(1, 800)))) for u, v in chosen]
    bandwidth = draw(st.sampled_from([None, 50.0, 100.0, 400.0]))
    graph = ModelGraph(layers, edges, bandwidth=bandwidth)
    speeds = draw(
        st.one_of(st.none(), st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=p, max_size=p))
    )
    schedule = draw(st.sampled_from(list(ScheduleMemory)))
    microbatches = draw(st.sampled_from([None, 1, 2, 8]))
    total_memory = sum(
        layer.params * (1 + OPTIMIZER) + layer.extra_memory + p * layer.activation
        for layer in layers
    )
    cap = draw(
        st.one_of(st.none(), st.floats(0.05, 1.2).map(lambda f: float(round(f * total_memory)) + 1))
    )
    return {
        "graph": graph,
        "p": p,
        "speeds": speeds,
        "schedule": schedule,
        "m": microbatches,
        "cap": cap,
    }


def check_against_brute_force(problem: dict) -> None:
    graph, p = problem["graph"], problem["p"]
    speeds = problem["speeds"] or [1.0] * p
    inflight = inflight_of(problem["schedule"], p, problem["m"])
    cap = problem["cap"]
    scale = sum(layer.compute for layer in graph.layers) / min(speeds)
    if graph.bandwidth:
        scale += 2 * sum(edge.bytes for edge in graph.edges) / graph.bandwidth
    best, best_memory = math.inf, math.inf
    for cuts in all_boundaries(graph.num_layers, p):
        compute, comm, memory = naive_costs(graph, cuts, speeds, inflight, graph.bandwidth)
        best_memory = min(best_memory, max(memory))
        if cap is None or max(memory) <= cap:
            best = min(best, max(c + m for c, m in zip(compute, comm, strict=True)))
    options = {
        "speeds": problem["speeds"],
        "schedule_memory": problem["schedule"],
        "num_microbatches": problem["m"],
        "memory_cap": cap,
        "optimizer_bytes_per_param_byte": OPTIMIZER,
    }
    if best == math.inf:
        with pytest.raises(InfeasibleMemoryError) as raised:
            partition_graph(graph, p, **options)
        assert close(raised.value.minimum_cap, best_memory)
        assert raised.value.minimum_cap > cap
        return
    result = partition_graph(graph, p, **options)
    cuts = result.boundaries
    # Every layer exactly once, contiguous, non-empty stages.
    assert len(cuts) == p + 1 and cuts[0] == 0 and cuts[-1] == graph.num_layers
    assert all(cuts[k] < cuts[k + 1] for k in range(p))
    assert sorted(i for k in range(p) for i in result.layers_of(k)) == list(range(graph.num_layers))
    # The reported costs are the definitions' costs.
    compute, comm, memory = naive_costs(graph, cuts, speeds, inflight, graph.bandwidth)
    assert all(close(a, b, scale) for a, b in zip(result.compute, compute, strict=True))
    assert all(close(a, b, scale) for a, b in zip(result.comm, comm, strict=True))
    assert all(close(a, b) for a, b in zip(result.memory, memory, strict=True))
    # Within the cap, and no feasible partition has a smaller bottleneck.
    if cap is not None:
        assert max(result.memory) <= cap
    assert close(result.bottleneck, best, scale)


@settings(max_examples=300, deadline=None)
@given(problems())
def test_balanced_chain_matches_brute_force(problem: dict) -> None:
    check_against_brute_force(problem)


@settings(max_examples=200, deadline=None)
@given(problems(dag=True))
def test_balanced_dag_with_skip_edges_matches_brute_force(problem: dict) -> None:
    check_against_brute_force(problem)


@settings(max_examples=150, deadline=None)
@given(problems(dag=True, extreme=True))
def test_extreme_magnitudes_are_optimal_up_to_prefix_rounding(problem: dict) -> None:
    check_against_brute_force(problem)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(st.integers(0, 9).map(float), st.floats(0, 100)), min_size=1, max_size=10),
    st.integers(1, 5),
)
def test_partition_weights_matches_brute_force(weights: list[float], p: int) -> None:
    p = min(p, len(weights))
    cuts = partition_weights(weights, p)
    assert len(cuts) == p + 1 and cuts[0] == 0 and cuts[-1] == len(weights)
    assert all(cuts[k] < cuts[k + 1] for k in range(p))
    found = max(sum(weights[cuts[k] : cuts[k + 1]]) for k in range(p))
    best = min(
        max(sum(weights[c[k] : c[k + 1]]) for k in range(p))
        for c in all_boundaries(len(weights), p)
    )
    assert close(found, best)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(0, 10), min_size=1, max_size=9), st.integers(1, 5), st.booleans())
def test_three_solvers_agree_on_plain_chains(weights: list[float], p: int, capped: bool) -> None:
    """bisection, the parametric probe and the DAG DP solve the same plain chain."""
    p = min(p, len(weights))
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    memory = np.concatenate(([0.0], np.cumsum(np.arange(1, len(weights) + 1, dtype=float))))
    cap = float(memory[-1]) / p + len(weights) if capped else None
    monotone = solve_monotone(prefix, p, memory_prefix=memory if capped else None, memory_cap=cap)
    same = np.ones((p, 1))
    compute, memory_model = LinearPrefix((prefix,), same), LinearPrefix((memory,), same)
    chain = solve_chain(ChainCosts(compute, np.zeros(len(prefix)), memory_model, cap))
    empty = np.zeros(0, dtype=np.int64)
    dag = solve_dag(
        DagCosts(len(weights), compute, empty, empty, empty.astype(float), memory_model, cap)
    )
    assert monotone is not None and chain is not None and dag is not None
    assert close(monotone.bottleneck, chain[1]) and close(monotone.bottleneck, dag[1])


def test_large_chain_is_optimal_by_an_independent_greedy_check() -> None:
    """n = 100,000, p = 128: a greedy feasibility check just below the bottleneck fails."""
    rng = np.random.default_rng(7)
    weights = rng.lognormal(0.0, 1.0, 100_000)
    p = 128
    cuts = partition_weights(weights, p)
    prefix = np.concatenate(([0.0], np.cumsum(weights)))
    stage_sums = prefix[list(cuts[1:])] - prefix[list(cuts[:-1])]
    bottleneck = float(stage_sums.max())

    def greedy_fits(bound: float) -> bool:
        start = 0
        for _ in range(p):
            start = int(np.searchsorted(prefix, prefix[start] + bound, side="right")) - 1
            if start >= len(weights):
                return True
        return False

    assert greedy_fits(bottleneck * (1 + 1e-12))
    assert not greedy_fits(bottleneck * (1 - 1e-9))
