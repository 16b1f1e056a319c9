"""Two-batch overlap of an F outside a pair: `two_batch_forward` against the engine's turn
protocol and a hand-derived closed form written here, the simulator's F spans, lane rows and
makespan against them, and planted bugs the checks catch."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules.analysis.simulate as simulate_module
from schedules import CostModel, Kind, ScheduleConfigError, build_schedule, figures, simulate
from schedules.analysis.all_to_all import (
    TWO_BATCH_ORDER,
    CommSpan,
    ExpertAllToAll,
    PairSchedule,
    overlapped_pair,
    two_batch_forward,
)
from schedules.analysis.costs import per_stage
from schedules.analysis.dataflow import execute
from schedules.analysis.runs import ComputeRuns
from schedules.analysis.simulate import simulate_unless_over
from schedules.analysis.timeline import KIND_CODES, Timeline
from schedules.ir.schedule import Schedule

seconds = st.floats(0.0, 10.0, allow_nan=False).map(lambda x: round(x, 3))


def turn_oracle(c: float, a: float, *, quarter: float = 4.0) -> tuple[float, list[float]]:
    """The engine's protocol, from its definition: halves X and Y, each a chain compute,
    exchange, compute, exchange of c/4 and a/4; X holds the turn first; the holder waits for
    its own last exchange, computes, launches its next exchange on the lane (one at a time,
    in launch order) and hands the turn over. (end, the exchanges' starts and ends)."""
    turn_free = lane_free = 0.0
    exchange_end = {"X": 0.0, "Y": 0.0}
    lane: list[float] = []
    for _, half in itertools.product(range(2), "XY"):
        launched = max(turn_free, exchange_end[half]) + c / quarter
        start = max(launched, lane_free)
        lane_free = exchange_end[half] = start + a / quarter
        lane += [start, lane_free]
        turn_free = launched
    return max(turn_free, *exchange_end.values()), lane


def closed_form(c: float, a: float) -> float:
    """Worked by hand from the issue order with u = c/4, v = a/4: u + v + 3·max(u, v)."""
    return (c + a + 3 * max(c, a)) / 4


@pytest.mark.parametrize(("c", "a", "expected"), [
    (2.0, 2.0, 2.5), (2.0, 4.0, 4.5), (4.0, 2.0, 4.5), (3.0, 0.0, 3.0), (0.0, 3.0, 3.0),
    (0.0, 0.0, 0.0), (1.0, 8.0, 8.25)])
def test_hand_computed_values(c: float, a: float, expected: float) -> None:
    laid = two_batch_forward(c, a)
    assert laid.end == laid.forward_end == pytest.approx(expected, abs=1e-12)
    assert turn_oracle(c, a)[0] == pytest.approx(expected, abs=1e-12)
    assert closed_form(c, a) == pytest.approx(expected, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(seconds, seconds)
def test_two_batch_forward_follows_the_turn_protocol(c: float, a: float) -> None:
    laid = two_batch_forward(c, a)
    end, lane = turn_oracle(c, a)
    assert laid.end == pytest.approx(end, abs=1e-9) and laid.forward_end == laid.end
    assert laid.end == pytest.approx(closed_form(c, a), abs=1e-9)
    if a == 0:  # a stage without an all-to-all: nothing on the lane, F runs whole
        assert laid.lane == () and laid.end == pytest.approx(c, abs=1e-9)
        return
    assert [x for part in laid.lane for x in (part.start, part.end)] == \
        pytest.approx(lane, abs=1e-9)
    assert all(part.op == "F" for part in laid.lane) and len(laid.lane) == 4
    assert all(x.end <= y.start + 1e-12 for x, y in itertools.pairwise(laid.lane))  # one lane
    assert max(c, a) - 1e-9 <= laid.end <= c + a + 1e-9  # never worse than exposed


def test_issue_order_is_the_turn_order() -> None:
    assert TWO_BATCH_ORDER == tuple(
        (half, resource, part) for part in range(2) for half in "XY"
        for resource in ("compute", "lane"))


def test_planted_bugs_change_the_values() -> None:
    # not halving the microbatch (each half's parts those of the whole op): 5, not 2.5
    assert turn_oracle(2.0, 2.0, quarter=2.0)[0] == 5.0 != two_batch_forward(2.0, 2.0).end

    # no turn-taking (X's whole chain issued before Y's): 3.5, not 2.5
    def issued(order: Sequence[tuple[str, str]], c: float, a: float) -> float:
        chain_end = {"X": 0.0, "Y": 0.0}
        free = {"compute": 0.0, "lane": 0.0}
        for half, resource in order:
            start = max(chain_end[half], free[resource])
            chain_end[half] = free[resource] = start + (c if resource == "compute" else a) / 4
        return max(chain_end.values())

    x_then_y = [(half, resource) for half in "XY" for _ in range(2)
                for resource in ("compute", "lane")]
    assert issued(x_then_y, 2.0, 2.0) == 3.5 != two_batch_forward(2.0, 2.0).end
    turns = [(half, resource) for half, resource, _ in TWO_BATCH_ORDER]
    assert issued(turns, 2.0, 2.0) == two_batch_forward(2.0, 2.0).end
    # Y first is no bug: the halves are equal, so the order of the turn is symmetric
    assert turn_oracle(2.0, 4.0)[0] == two_batch_forward(2.0, 4.0).end


@pytest.mark.parametrize("value", [1, "yes", None])
def test_two_batch_must_be_a_bool(value: object) -> None:
    with pytest.raises(ScheduleConfigError, match=f"two_batch must be True or False, got "
                                                  f"{value!r}"):
        CostModel(all_to_all=ExpertAllToAll(forward=1.0, two_batch=value))  # type: ignore[arg-type]


def bench_model(r: float, two_batch: bool, a2a_forward: float | list[float] = 2.0,
                t: float = 1.0) -> CostModel:
    """benchmarks/bench_moe_overlap.py's cost model at p = 4 (8 stages), backward ratio r."""
    b = r * t
    return CostModel(forward=2 * t, backward=[b / 2 if s == 0 else b for s in range(8)],
                     weight=b, all_to_all=ExpertAllToAll(forward=a2a_forward, backward=2 * t,
                                                         two_batch=two_batch))


def problems(schedule: Schedule, costs: CostModel, timeline: Timeline) -> list[str]:
    """What in `timeline` breaks the two-batch rule: an F outside a pair on a stage with an
    all-to-all lasts `closed_form` and has `turn_oracle`'s lane rows; elsewhere an F alone
    lasts compute + all-to-all with none hidden; a pair lasts `overlapped_pair`."""
    assert costs.all_to_all is not None
    forward, backward, weight, _, _ = costs.resolve(schedule.num_stages)
    a2a = per_stage("a2a", costs.all_to_all.forward, schedule.num_stages)
    a2a_b = per_stage("a2a", costs.all_to_all.backward, schedule.num_stages)
    found: list[str] = []

    def span(rank: int, kind: Kind, s: int, i: int) -> tuple[float, float]:
        row = np.flatnonzero((timeline.rank == rank) & (timeline.kind == KIND_CODES[kind])
                             & (timeline.stage == s) & (timeline.microbatch == i))
        assert len(row) == 1
        return float(timeline.start[row[0]]), float(timeline.end[row[0]])

    for rank, stream in enumerate(schedule.compute_streams()):
        for k, (kind, s, i, _) in enumerate(stream):
            if kind is not Kind.F:
                continue
            start, end = span(rank, Kind.F, s, i)
            if k + 1 < len(stream) and stream[k + 1][0] is Kind.OVERLAP_B:
                s2, i2 = stream[k + 1][1], stream[k + 1][2]
                want = overlapped_pair(forward[s], a2a[s], backward[s2] + weight[s2], a2a_b[s2],
                                       two_batch=costs.all_to_all.two_batch).end
                if abs(span(rank, Kind.OVERLAP_B, s2, i2)[1] - start - want) > 1e-9:
                    found.append(f"pair F{s},{i}: not {want}")
                continue
            alone = a2a[s] > 0
            want = closed_form(forward[s], a2a[s]) if alone else forward[s]
            if abs(end - start - want) > 1e-9:
                found.append(f"F{s},{i} lasts {end - start}, not {want}")
            rows = (timeline.rank == rank) & (timeline.kind == KIND_CODES[Kind.ALL_TO_ALL]) \
                & (timeline.stage == s) & (timeline.microbatch == i) \
                & (timeline.start >= start - 1e-9) & (timeline.end <= end + 1e-9)
            lane = [x - start for row in np.flatnonzero(rows)
                    for x in (timeline.start[row], timeline.end[row])]
            wanted = turn_oracle(forward[s], a2a[s])[1] if alone else []
            if len(lane) != len(wanted) or not np.allclose(sorted(lane), wanted, atol=1e-9):
                found.append(f"F{s},{i} lane {lane}, not {wanted}")
    return found


def makespan_oracle(schedule: Schedule, costs: CostModel) -> float:
    """`execute` run here with every F alone priced `closed_form` (compute alone where the
    stage has no all-to-all), B and I with theirs exposed, a pair by `overlapped_pair`."""
    assert costs.all_to_all is not None
    forward, backward, weight, delay, _ = costs.resolve(schedule.num_stages)
    a2a = per_stage("a2a", costs.all_to_all.forward, schedule.num_stages)
    a2a_b = per_stage("a2a", costs.all_to_all.backward, schedule.num_stages)

    def pair(s: int, s2: int) -> tuple[float, float]:
        return 0.0, overlapped_pair(forward[s], a2a[s], backward[s2] + weight[s2], a2a_b[s2],
                                    two_batch=costs.all_to_all.two_batch).end

    run = execute(schedule.compute_streams(), schedule.placement, schedule.num_microbatches,
                  [closed_form(f, a) if a > 0 else f for f, a in zip(forward, a2a)],
                  [b + x for b, x in zip(backward, a2a_b)], weight, delay, 1.0, None, pair)
    return max(max(ends) for ends in run.ends)


SCHEDULE = build_schedule("dualpipev-overlap", 4, 8, 2)


@pytest.mark.parametrize(("r", "a2a_forward"), [(1.0, 2.0), (2.0, 2.0),
                                                (1.0, [0.0, 2.0, 4.0, 0.0, 1.0, 2.0, 0.0, 3.0])])
def test_simulated_two_batch_forward(r: float, a2a_forward: float | list[float]) -> None:
    costs = bench_model(r, True, a2a_forward)
    timeline = simulate(SCHEDULE, costs)
    assert problems(SCHEDULE, costs, timeline) == []
    assert figures(timeline).makespan == pytest.approx(makespan_oracle(SCHEDULE, costs),
                                                       abs=1e-9)


def test_bench_makespans() -> None:
    # off: today's values (docs/benchmarks.md's simulated column, t = 10 ms there)
    assert figures(simulate(SCHEDULE, bench_model(1.0, False))).makespan == 117.5
    assert figures(simulate(SCHEDULE, bench_model(2.0, False))).makespan == 149.0
    plain = build_schedule("dualpipev", 4, 8, 2)
    assert figures(simulate(plain, bench_model(1.0, False))).makespan == 145.5
    assert figures(simulate(SCHEDULE, bench_model(1.0, True))).makespan == 99.5
    assert figures(simulate(SCHEDULE, bench_model(2.0, True))).makespan == 133.0


def test_the_checks_catch_planted_bugs(monkeypatch: pytest.MonkeyPatch) -> None:
    costs = bench_model(1.0, True)
    # the feature ignored: every F alone exposes its all-to-all
    off = simulate(SCHEDULE, bench_model(1.0, False))
    assert problems(SCHEDULE, costs, off)
    assert figures(off).makespan != makespan_oracle(SCHEDULE, costs)

    # no halving: each half's parts those of the whole op
    def unhalved(c: float, a: float) -> PairSchedule:
        laid = two_batch_forward(2 * c, 2 * a)
        return PairSchedule(laid.end, laid.end, laid.lane)

    monkeypatch.setattr(simulate_module, "two_batch_forward", unhalved)
    assert problems(SCHEDULE, costs, simulate(SCHEDULE, costs))

    # lane rows laid as an F alone's (op_spans) while the span is priced two-batch
    def exposed_lane(c: float, a: float) -> PairSchedule:
        laid = two_batch_forward(c, a)
        return PairSchedule(laid.end, laid.end, (CommSpan("F", c / 2, (c + a) / 2),
                                                 CommSpan("F", c + a / 2, c + a)))

    monkeypatch.setattr(simulate_module, "two_batch_forward", exposed_lane)
    assert problems(SCHEDULE, costs, simulate(SCHEDULE, costs))
    monkeypatch.undo()

    # a pair priced otherwise (e.g. its F split in two as well)
    def slower_pair(*times: float, **options: bool) -> PairSchedule:
        laid = overlapped_pair(*times, **options)
        return laid._replace(end=laid.end + 0.5)

    monkeypatch.setattr(simulate_module, "overlapped_pair", slower_pair)
    assert problems(SCHEDULE, costs, simulate(SCHEDULE, costs))


def test_kept_runs_tell_two_batch_apart() -> None:
    # a regression guard: the kept compute run's key holds two_batch
    runs = ComputeRuns()
    assert figures(simulate(SCHEDULE, bench_model(1.0, False), runs=runs)).makespan == 117.5
    assert figures(simulate(SCHEDULE, bench_model(1.0, True), runs=runs)).makespan == 99.5


@pytest.mark.parametrize("name", ["dualpipev", "dualpipev-overlap"])
def test_limited_run_bounds_by_the_two_batch_price(name: str) -> None:
    # a limited run's rooms price an F alone by the same list `execute` does: a run whose
    # ranks end by their limits is whole, one a hair over is stopped
    schedule, costs = build_schedule(name, 4, 8, 2), bench_model(1.0, True)
    timeline = simulate(schedule, costs)
    ends = [float(timeline.end[timeline.rank == rank].max()) for rank in range(4)]
    assert simulate_unless_over(schedule, costs, ends) is not None
    assert simulate_unless_over(schedule, costs, [end - 0.01 for end in ends]) is None


def _pair_of_halves(fc: float, fa: float, bc: float, ba: float) -> float:
    """Oracle from the engine's rule: inside a pair, F runs its two halves one after the
    other and B (a graph of two halves) hands over at each half's all-to-all, so each thread
    is its op's chain twice at half size, and the turns follow the pair's order twice. An op
    of a dense stage has no all-to-all and no halves: a dense B runs whole before F's halves
    (all exposed); a dense F runs whole while B's first quarter all-to-all is in flight, and
    B's other parts follow, each exposed."""
    if ba == 0:
        return bc + fc + fa
    if fa == 0:
        return max(fc, ba / 4) + 3 * ba / 4 + bc
    chain = {"F": [("compute", fc / 4), ("lane", fa / 4)] * 4,
             "B": [("lane", ba / 4), ("compute", bc / 4)] * 4}
    order = [("B", "lane"), ("F", "compute"), ("B", "compute"), ("F", "lane"),
             ("F", "compute"), ("B", "lane"), ("B", "compute"), ("F", "lane")] * 2
    position = {"F": 0, "B": 0}
    ends = {"F": 0.0, "B": 0.0}
    free = {"compute": 0.0, "lane": 0.0}
    for op, resource in order:
        kind, cost = chain[op][position[op]]
        assert kind == resource
        position[op] += 1
        ends[op] = free[resource] = max(ends[op], free[resource]) + cost
    return max(ends.values())


@settings(max_examples=300, deadline=None)
@given(seconds, seconds, seconds, seconds)
def test_a_pair_of_halves_costs_the_whole_pair(fc: float, fa: float, bc: float,
                                               ba: float) -> None:
    """Why a pair is priced as without two-batch where both ops have an all-to-all: its
    halves' order ends with the pair; beside a dense op the halves expose more."""
    halves = overlapped_pair(fc, fa, bc, ba, two_batch=True).end
    assert _pair_of_halves(fc, fa, bc, ba) == pytest.approx(halves, abs=1e-9)
    if fa > 0 and ba > 0:
        assert halves == pytest.approx(overlapped_pair(fc, fa, bc, ba).end, abs=1e-9)
