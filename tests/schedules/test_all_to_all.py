"""The expert all-to-all on the simulator's lane: the overlapped pair's rule against a longest-path
oracle written here from its definition, exposed all-to-all in ops run alone, and planted bugs."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules.analysis.simulate as simulate_module
from schedules import CostModel, Kind, ScheduleConfigError, build_schedule, figures, simulate
from schedules.analysis.all_to_all import ExpertAllToAll, overlapped_pair
from schedules.analysis.timeline import KIND_CODES

seconds = st.floats(0.0, 10.0, allow_nan=False).map(lambda x: round(x, 3))


def pair_oracle(fc: float, fa: float, bc: float, ba: float) -> float:
    """The definition as a graph: F's chain attention → dispatch → experts → combine, B's
    combine' → experts' → dispatch' → attention' (halves of c and a), and each resource's
    order compute F.att, B.exp', F.exp, B.att' / lane B.comb', F.disp, B.disp', F.comb.
    The pair lasts the longest path. An op of a dense stage (a = 0) has no all-to-all to
    hand the turn over at: it is one compute part, run where it first holds the turn (a
    dense B, which starts, before all of F; a dense F while B's first all-to-all is in
    flight, before B's compute)."""
    durations = {"Fc1": fc / 2, "Fa1": fa / 2, "Fc2": fc / 2, "Fa2": fa / 2,
                 "Ba1": ba / 2, "Bc1": bc / 2, "Ba2": ba / 2, "Bc2": bc / 2,
                 "Fc": fc, "Bc": bc}
    graph = nx.DiGraph()
    if fa == 0 and ba == 0:
        paths = [["Bc", "Fc"]]
    elif ba == 0:
        paths = [["Bc", "Fc1", "Fa1", "Fc2", "Fa2"]]
    elif fa == 0:
        paths = [["Ba1", "Bc1", "Ba2", "Bc2"], ["Fc", "Bc1"]]
    else:
        paths = [["Fc1", "Fa1", "Fc2", "Fa2"], ["Ba1", "Bc1", "Ba2", "Bc2"],
                 ["Fc1", "Bc1", "Fc2", "Bc2"], ["Ba1", "Fa1", "Ba2", "Fa2"]]
    for path in paths:
        nx.add_path(graph, path)
    finish: dict[str, float] = {}
    for node in nx.topological_sort(graph):
        finish[node] = max((finish[u] for u in graph.predecessors(node)), default=0.0) \
            + durations[node]
    return max(finish.values())


@settings(max_examples=200, deadline=None)
@given(seconds, seconds, seconds, seconds)
def test_overlapped_pair_is_the_longest_path(fc: float, fa: float, bc: float, ba: float) -> None:
    laid = overlapped_pair(fc, fa, bc, ba)
    assert laid.end == pytest.approx(pair_oracle(fc, fa, bc, ba), abs=1e-9)
    assert max(fc + bc, fa + ba) - 1e-9 <= laid.end <= fc + fa + bc + ba + 1e-9
    spans = sorted((part.start, part.end) for part in laid.lane)
    assert all(a[1] <= b[0] + 1e-12 for a, b in itertools.pairwise(spans))  # one lane: no overlap


def test_pair_without_all_to_all_costs_back_to_back() -> None:
    assert overlapped_pair(3.0, 0.0, 5.0, 0.0).end == 8.0


def test_a_dense_op_in_a_pair_runs_whole_as_the_engine_runs_it() -> None:
    # issue 43: a dense stage's op was priced as if its halves interleaved with the other's
    # all-to-all (a dense B of 2 beside F = 2 + 2: 3.0), but the engine's dense B has no
    # point to hand the turn over at: it runs whole, then F with its all-to-all exposed
    assert overlapped_pair(2.0, 2.0, 2.0, 0.0).end == 6.0
    # a dense F of 2 runs whole while B's first all-to-all half (1) is in flight, then B's
    # experts' (1), dispatch' (1) and attention' (1): 5, where interleaving priced 4
    assert overlapped_pair(2.0, 0.0, 2.0, 2.0).end == 5.0
    assert overlapped_pair(2.0, 0.0, 2.0, 2.0).forward_end == 2.0  # its thread ends first


def test_equal_compute_and_all_to_all_halve_the_pair() -> None:
    # DeepSeek's case: each half of one op's all-to-all hidden under a half of the other's compute
    assert overlapped_pair(2.0, 2.0, 2.0, 2.0).end == 4.0


def test_dependency_is_respected_not_only_the_resource_sums() -> None:
    # a planted bug: max(compute sums, comm sums) ignores that F's combine waits for its experts
    def resource_sums(fc: float, fa: float, bc: float, ba: float) -> float:
        return max(fc + bc, fa + ba)

    assert resource_sums(1.0, 1.0, 0.0, 0.0) != pair_oracle(1.0, 1.0, 0.0, 0.0)
    assert overlapped_pair(1.0, 1.0, 0.0, 0.0).end == pair_oracle(1.0, 1.0, 0.0, 0.0) == 2.0


def single_rank_oracle(m: int, f: float, b: float, w: float, af: float, ab: float) -> float:
    """dualpipev-overlap on one rank never waits on another: the step is the sum of its ops,
    an op alone costing compute + all-to-all, a pair `pair_oracle`."""
    stream = build_schedule("dualpipev-overlap", 1, m).compute_streams()[0]
    total, k = 0.0, 0
    cost = {Kind.F: (f, af), Kind.B: (b + w, ab), Kind.OVERLAP_B: (b + w, ab), Kind.I: (b, ab),
            Kind.W: (w, 0.0)}
    while k < len(stream):
        kind = stream[k][0]
        if kind is Kind.F and k + 1 < len(stream) and stream[k + 1][0] is Kind.OVERLAP_B:
            total += pair_oracle(f, af, b + w, ab)
            k += 2
            continue
        total += sum(cost[kind])
        k += 1
    return total


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), seconds, seconds, seconds, seconds, seconds)
def test_simulated_single_rank_step_matches_the_oracle(m: int, f: float, b: float, w: float,
                                                      af: float, ab: float) -> None:
    costs = CostModel(forward=f, backward=b, weight=w,
                      all_to_all=ExpertAllToAll(forward=af, backward=ab))
    timeline = simulate(build_schedule("dualpipev-overlap", 1, m), costs)
    assert figures(timeline).makespan == pytest.approx(
        single_rank_oracle(m, f, b, w, af, ab), abs=1e-6)


def test_a_pair_priced_by_resource_sums_fails_the_oracle(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A planted bug in the simulator's pair price is caught by the single-rank oracle."""
    real = simulate_module.overlapped_pair

    def wrong(fc: float, fa: float, bc: float, ba: float,  # type: ignore[no-untyped-def]
              **options: bool):
        return real(fc, fa, bc, ba, **options)._replace(end=max(fc + bc, fa + ba))

    monkeypatch.setattr(simulate_module, "overlapped_pair", wrong)
    costs = CostModel(forward=2.0, backward=1.0, weight=1.0,
                      all_to_all=ExpertAllToAll(forward=3.0, backward=0.5))
    got = figures(simulate(build_schedule("dualpipev-overlap", 1, 4), costs)).makespan
    assert got != pytest.approx(single_rank_oracle(4, 2.0, 1.0, 1.0, 3.0, 0.5))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3), st.lists(seconds, min_size=5, max_size=5))
def test_ops_alone_expose_their_all_to_all(p: int, extra: int, costs: list[float]) -> None:
    """Without pairs, an all-to-all is a longer op: the same as adding it to F and to I."""
    f, b, w, af, ab = costs
    schedule = build_schedule("dualpipev", p, 2 * p + extra)
    with_lane = simulate(schedule, CostModel(forward=f, backward=b, weight=w,
                                             all_to_all=ExpertAllToAll(forward=af,
                                                                       backward=ab)))
    folded = simulate(schedule, CostModel(forward=f + af, backward=b + ab, weight=w))
    assert figures(with_lane).makespan == pytest.approx(figures(folded).makespan, abs=1e-6)
    lane = with_lane.kind == KIND_CODES[Kind.ALL_TO_ALL]
    # every F and every B / I carries its all-to-all on the lane, whole
    ops = with_lane.kind[~lane]
    expected = af * np.isin(ops, [KIND_CODES[Kind.F]]).sum() + ab * np.isin(
        ops, [KIND_CODES[k] for k in (Kind.B, Kind.I)]).sum()
    assert float((with_lane.end - with_lane.start)[lane].sum()) == pytest.approx(expected,
                                                                                abs=1e-6)


def test_lane_rows_sit_inside_their_ops_and_never_overlap_on_a_rank() -> None:
    costs = CostModel(forward=2.0, backward=1.0, weight=1.0,
                      all_to_all=ExpertAllToAll(forward=2.0, backward=2.0))
    timeline = simulate(build_schedule("dualpipev-overlap", 4, 8), costs)
    lane = timeline.kind == KIND_CODES[Kind.ALL_TO_ALL]
    assert lane.any()
    for rank in range(4):
        rows = sorted(zip(timeline.start[lane & (timeline.rank == rank)],
                          timeline.end[lane & (timeline.rank == rank)]))
        assert all(a[1] <= b[0] + 1e-9 for a, b in itertools.pairwise(rows))
        compute = timeline.compute_mask() & (timeline.rank == rank)
        spans = list(zip(timeline.start[compute], timeline.end[compute]))
        assert all(any(s - 1e-9 <= a and e <= t + 1e-9 for s, t in spans) for a, e in rows)


def test_overlap_pays_off_where_all_to_all_equals_compute() -> None:
    costs = CostModel(forward=2.0, backward=1.0, weight=1.0,
                      all_to_all=ExpertAllToAll(forward=2.0, backward=2.0))
    plain = figures(simulate(build_schedule("dualpipev", 4, 8), costs)).makespan
    paired = figures(simulate(build_schedule("dualpipev-overlap", 4, 8), costs)).makespan
    assert paired < 0.85 * plain


def test_without_all_to_all_the_model_is_unchanged() -> None:
    for overlap in (1.0, 0.7):
        costs = CostModel(forward=1.0, backward=2.0, weight=1.0, overlap=overlap)
        timeline = simulate(build_schedule("dualpipev-overlap", 3, 7), costs)
        assert not (timeline.kind == KIND_CODES[Kind.ALL_TO_ALL]).any()
    zero = CostModel(all_to_all=ExpertAllToAll())
    for name in ("dualpipev", "dualpipev-overlap", "1f1b"):
        schedule = build_schedule(name, 3, 6)
        assert figures(simulate(schedule, zero)).makespan == \
            figures(simulate(schedule, CostModel())).makespan


def test_bad_all_to_all_is_refused_where_written() -> None:
    with pytest.raises(ScheduleConfigError, match="not both"):
        CostModel(overlap=0.7, all_to_all=ExpertAllToAll(forward=1.0))
    with pytest.raises(ScheduleConfigError, match=r"all_to_all\.forward"):
        CostModel(all_to_all=ExpertAllToAll(forward=-1.0))
    with pytest.raises(ScheduleConfigError, match="ExpertAllToAll"):
        CostModel(all_to_all=1.0)  # type: ignore[arg-type]
    with pytest.raises(ScheduleConfigError, match="stages"):
        simulate(build_schedule("dualpipev", 2, 4),
                 CostModel(all_to_all=ExpertAllToAll(forward=[1.0, 1.0])))
