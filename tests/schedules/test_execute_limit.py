"""A limited run (`dataflow.execute(limit=...)`, `simulate_unless_over`) stops only on a rank
whose whole run ends past its limit, and never on a run whose every rank ends by its own;
checked against the unlimited run as the oracle, and against planted over-eager stops."""

from __future__ import annotations

import itertools
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import schedules.analysis.dataflow as dataflow
from schedules import ComputeRuns, CostModel, GradReduction, generate_schedule, simulate
from schedules.analysis.all_to_all import ExpertAllToAll
from schedules.analysis.simulate import simulate_unless_over

from .test_compute_runs import same

__all__: list[str] = []

# (name, p, m, v): plain, split-backward, V-shaped and overlapped-pair schedules
SHAPES = [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2), ("zb-h1", 4, 6, 1),
          ("zb-v", 3, 6, 2), ("dualpipev-overlap", 2, 4, 2)]
COST = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_infinity=False)


def _run(name: str, p: int, m: int, v: int, forward: list[float], backward: list[float],
         weight: list[float], delay: list[float], limit: list[float] | None
         ) -> dataflow.Execution:
    schedule = generate_schedule(name, p, m, v)
    return dataflow.execute(schedule.compute_streams(), schedule.placement, m, forward,
                            backward, weight, delay, 0.8, None, None, limit)


def _ends(run: dataflow.Execution) -> list[float]:
    return [max(ends, default=0.0) for ends in run.ends]


@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from(SHAPES), data=st.data())
def test_a_run_stops_only_past_a_limit_it_would_pass(shape: tuple[str, int, int, int],
                                                     data: st.DataObject) -> None:
    name, p, m, v = shape
    stages = p * v
    costs = [data.draw(st.lists(COST, min_size=stages, max_size=stages)) for _ in range(4)]
    whole = _run(name, p, m, v, *costs, None)
    ends = _ends(whole)
    # each rank's limit: its own end (never a stop), or a share of it (a stop only if some
    # rank passes its limit, and then the one named does)
    shares = data.draw(st.lists(st.sampled_from([1.0, 1.0, 0.999, 0.9, 0.5, 0.0]),
                                min_size=p, max_size=p))
    limit = [end * share for end, share in zip(ends, shares)]
    limited = _run(name, p, m, v, *costs, limit)
    if limited.over is None:
        assert limited.starts == whole.starts and limited.ends == whole.ends
        assert limited.stuck == whole.stuck == {}
    else:
        assert ends[limited.over] > limit[limited.over]
    if all(end <= most for end, most in zip(ends, limit)):
        assert limited.over is None


@pytest.mark.parametrize("shape", SHAPES, ids=[shape[0] for shape in SHAPES])
def test_a_run_at_exactly_its_limit_finishes_and_one_far_past_stops_early(
        shape: tuple[str, int, int, int]) -> None:
    name, p, m, v = shape
    stages = p * v
    costs = ([1.0 + s % 3 for s in range(stages)], [1.5] * stages, [0.5] * stages,
             [0.2] * stages)
    whole = _run(name, p, m, v, *costs, None)
    ends = _ends(whole)
    at = _run(name, p, m, v, *costs, ends)  # an end equal to the limit is not past it
    assert at.over is None and at.ends == whole.ends
    half = [end / 2 for end in ends]
    stopped = _run(name, p, m, v, *costs, half)
    assert stopped.over is not None
    if name != "dualpipev-overlap":  # its pairs' ranks count only their clocks
        # the proof comes before the run ends: fewer ops ran than the schedule has
        assert sum(map(len, stopped.ends)) < sum(map(len, whole.ends))


def test_a_planted_eager_stop_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # rooms 1% short (a limit read as 1% lower): some run that ends by its limit stops
    honest = dataflow._rooms

    def eager(*args: object) -> list[float]:
        rooms: list[float] = honest(*args)  # type: ignore[arg-type]
        limit: list[float] = args[1]  # type: ignore[assignment]
        return [room - 0.01 * most for room, most in zip(rooms, limit)]

    monkeypatch.setattr(dataflow, "_rooms", eager)
    caught = False
    for name, p, m, v in SHAPES:
        stages = p * v
        costs = ([1.0] * stages, [2.0] * stages, [1.0] * stages, [0.1] * stages)
        ends = _ends(_run(name, p, m, v, *costs, None))
        caught |= _run(name, p, m, v, *costs, ends).over is not None
    assert caught


@pytest.mark.parametrize("name", ["1f1b", "zb-v"])
def test_simulate_unless_over_is_simulate_or_none_and_keeps_no_stopped_run(name: str) -> None:
    p, m, v = (4, 8, 1) if name == "1f1b" else (2, 4, 2)
    schedule = generate_schedule(name, p, m, v)
    model = CostModel(forward=[1.0, 1.5, 1.0, 2.0], backward=[1.0, 2.0, 1.5, 1.0],
                      weight=[0.5, 1.0, 0.5, 0.5], comm=0.1,
                      reduction=GradReduction(time=[2.0, 1.0, 3.0, 1.0], buckets=2))
    for variant in (model, CostModel(forward=1.0, all_to_all=ExpertAllToAll(
            forward=0.3, backward=0.2))):
        whole = simulate(schedule, variant)
        compute = whole.compute_mask()
        ends = [float(whole.end[compute & (whole.rank == rank)].max()) for rank in range(p)]
        runs = ComputeRuns()
        assert simulate_unless_over(schedule, variant, [end / 2 for end in ends],
                                    runs=runs) is None
        assert len(runs) == 0  # a stopped run is not kept as if it were whole
        for limit in (ends, [end * 2 for end in ends], [float("inf")] * p):
            kept = simulate_unless_over(schedule, variant, limit, runs=runs)
            assert kept is not None and same(kept, whole)
        assert len(runs) == 1
        # a kept whole run is checked against a lower limit too
        assert simulate_unless_over(schedule, variant, [end / 2 for end in ends],
                                    runs=runs) is None
        one_short = [*ends[:-1], ends[-1] * 0.999]
        assert simulate_unless_over(schedule, variant, one_short, runs=runs) is None
    with pytest.raises(ValueError, match="one per rank"):
        simulate_unless_over(schedule, model, [1.0])


def test_every_limited_run_of_a_grid_agrees_with_the_unlimited_one() -> None:
    # limits at each rank's end, one ulp under it, and at zero: stop exactly when some rank
    # is under its end by more than rounding
    name, p, m, v = "1f1b", 3, 5, 1
    costs = ([1.0, 2.0, 1.5], [2.0, 1.0, 1.0], [0.5, 0.5, 1.0], [0.3, 0.3, 0.3])
    ends = _ends(_run(name, p, m, v, *costs, None))
    for choice in itertools.product(("end", "zero"), repeat=p):
        limit = [end if pick == "end" else 0.0 for end, pick in zip(ends, choice)]
        over = _run(name, p, m, v, *costs, limit).over
        assert (over is None) == (choice == ("end",) * p)
        assert over is None or limit[over] == 0.0


def test_kept_op_counts_are_the_schedules_and_give_the_same_stop() -> None:
    runs = ComputeRuns()
    schedule = generate_schedule("zb-h1", 4, 6, 1)
    counts = runs.op_counts(schedule)
    assert runs.op_counts(schedule) is counts  # counted once
    assert counts == dataflow.op_counts(schedule.compute_streams())
    assert sum(sum(rank.values()) for rank in counts) == schedule.num_instructions
    held = weakref.ref(other := generate_schedule("1f1b", 4, 6, 1))
    runs.op_counts(other)
    del other
    assert held() is None  # the counts keep no schedule alive
    costs = ([1.0, 2.0, 1.5, 1.0], [2.0, 1.0, 1.0, 1.5], [0.5, 0.5, 1.0, 0.5], [0.3] * 4)
    ends = _ends(_run("zb-h1", 4, 6, 1, *costs, None))
    for limit in ([end * 0.9 for end in ends], ends):
        fresh = _run("zb-h1", 4, 6, 1, *costs, limit)
        kept = dataflow.execute(schedule.compute_streams(), schedule.placement, 6, *costs, 0.8,
                                None, None, limit, counts)
        assert kept == fresh
