"""Host costs: what a measured run spent beyond its nominal op costs, and the model it implies."""

from __future__ import annotations

from dataclasses import fields

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    CostModel,
    GradReduction,
    Kind,
    ParamGather,
    ScheduleConfigError,
    Span,
    Timeline,
    build_schedule,
    figures,
    simulate,
)
from schedules.analysis.host import HostCosts, Link, measure_host_costs, with_host_costs

__all__: list[str] = []

times = st.floats(0.5, 5.0)
overheads = st.floats(0.0, 0.5)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["1f1b", "gpipe", "zb-h1"]), m=st.integers(1, 8), f=times,
       b=times, w=times, host_f=overheads, host_b=overheads, host_w=overheads)
def test_host_time_of_a_single_rank_run_is_recovered(name: str, m: int, f: float, b: float,
                                                     w: float, host_f: float, host_b: float,
                                                     host_w: float) -> None:
    # one rank: no waits, so every op's extra time is host time
    schedule = build_schedule(name, 1, m)
    nominal = CostModel(forward=f, backward=b, weight=w)
    host = HostCosts({(Kind.F, 0): host_f, (Kind.B, 0): host_b, (Kind.I, 0): host_b,
                      (Kind.W, 0): host_w})
    slow = with_host_costs(nominal, host, schedule)
    measured = measure_host_costs(simulate(schedule, slow), nominal)
    for (kind, stage), value in measured.per_op.items():
        assert value == pytest.approx(host.of(kind, stage), abs=1e-9)


def test_receive_waits_are_not_host_time() -> None:
    spans = [Span(0, Kind.F, 0, 0, 0.0, 1.0),  # rank 0: F takes 1 (nominal 1)
             Span(1, Kind.RECV_F, 1, 0, 0.0, 1.5),  # rank 1 blocked until 1.5
             Span(1, Kind.F, 1, 0, 1.7, 2.7)]  # then 0.2 of host work before its F
    measured = Timeline.from_spans(spans, 2, unit="s")
    host = measure_host_costs(measured, CostModel(forward=1.0, backward=0.0, weight=0.0))
    assert host.per_op[(Kind.F, 0)] == pytest.approx(0.0)
    assert host.per_op[(Kind.F, 1)] == pytest.approx(0.2)


def test_host_costs_and_link_lengthen_the_simulation() -> None:
    schedule = build_schedule("1f1b", 4, 8)
    nominal = CostModel(forward=1.0, backward=1.0, weight=1.0, activation_bytes=100.0)
    host = HostCosts({(Kind.F, s): 0.1 for s in range(4)})
    machine = with_host_costs(nominal, host, schedule, Link(0.05, bandwidth=1000.0))
    assert machine.forward == [1.1] * 4
    assert machine.comm == 0.05 and machine.bandwidth == 1000.0
    assert figures(simulate(schedule, machine)).makespan > \
        figures(simulate(schedule, nominal)).makespan


def test_a_stage_without_a_measurement_takes_the_kinds_median() -> None:
    host = HostCosts({(Kind.F, 0): 1.0, (Kind.F, 1): 3.0})
    assert host.of(Kind.F, 5) == 2.0
    assert host.of(Kind.W, 0) == 0.0


@pytest.mark.parametrize("make", [lambda: Link(-1.0), lambda: Link(0.0, bandwidth=0.0),
                                  lambda: HostCosts({(Kind.F, 0): float("nan")})])
def test_bad_machine_values_are_refused(make) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ScheduleConfigError):
        make()


def test_an_overlapped_backward_is_measured_as_a_backward() -> None:
    # regression: a measured OVERLAP_B span (dualpipev-overlap on the engine) was a KeyError
    from schedules import Kind, Span, Timeline
    spans = [Span(0, Kind.F, 0, 0, 0.0, 1.0), Span(0, Kind.OVERLAP_B, 0, 0, 1.5, 3.5)]
    host = measure_host_costs(Timeline.from_spans(spans, 1, name="m"),
                              CostModel(forward=1.0, backward=1.0, weight=1.0))
    assert host.of(Kind.B, 0) == pytest.approx(0.5)


def test_host_costs_keep_dualpipe_overlap_fraction() -> None:
    # regression: with_host_costs rebuilt the CostModel without `overlap`, so a DualPipeV
    # F&B pair priced at 0.6 of F + B fell back to 1.0 once host costs were added
    schedule = build_schedule("dualpipev-overlap", 4, 8)
    nominal = CostModel(forward=1.0, backward=1.0, weight=1.0, overlap=0.6)
    kept = with_host_costs(nominal, HostCosts({}), schedule)
    assert kept.overlap == 0.6
    span = figures(simulate(schedule, kept)).makespan
    assert span == pytest.approx(figures(simulate(schedule, nominal)).makespan)
    assert span < figures(simulate(schedule, CostModel(forward=1.0, backward=1.0,
                                                       weight=1.0))).makespan


def test_host_costs_keep_every_field_they_do_not_change() -> None:
    # regression: the CostModel was rebuilt field by field, so each new field (overlap, then
    # reduction, then gather) was dropped until someone listed it
    schedule = build_schedule("1f1b", 2, 4)
    nominal = CostModel(forward=1.0, backward=1.0, weight=1.0, overlap=0.7,
                        reduction=GradReduction(time=2.0, buckets=2),
                        gather=ParamGather(time=1.0, buckets=2, overlap=True))
    kept = with_host_costs(nominal, HostCosts({}), schedule)
    changed = {"forward", "backward", "weight", "comm", "activation_bytes", "bandwidth"}
    for spec in fields(CostModel):
        if spec.name not in changed:
            assert getattr(kept, spec.name) == getattr(nominal, spec.name), spec.name
