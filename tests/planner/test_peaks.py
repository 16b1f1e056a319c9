"""Closed-form peaks against the built schedules' traces, and the memory floor the search
prunes with against every schedule's real peak."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.planner.bounds import FUSED_BACKWARD
from pipeline.planner.peaks import (
    CLOSED_FORMS,
    WARM_UP_FORMS,
    PeakCounts,
    closed_form_peaks,
    same_trace_as,
    warm_up_held,
)
from pipeline.planner.predict import is_cost_aware
from schedules import SCHEDULES, Kind, generate_schedule
from schedules.analysis.accounting import HeldTrace
from schedules.ir.limits import MAX_INSTRUCTIONS

__all__: list[str] = []

_FIXED = [name for name in SCHEDULES if not is_cost_aware(name) and name != "forward-only"]


def _chunks(name: str, data: st.DataObject) -> int:
    low, high = SCHEDULES[name].chunks
    return data.draw(st.integers(max(low, 1), high if high is not None else 4), label="v")


def _trace(name: str, p: int, m: int, v: int) -> HeldTrace | None:
    try:
        return HeldTrace.of(generate_schedule(name, p, m, v))
    except ValueError:
        return None


def _slack(trace: HeldTrace, sizes: np.ndarray) -> float:
    """The trace's rounding: it sums every rank's ops in one running sum, so a small rank
    after a large one is off by a few ulps of the large sums."""
    return 1e-12 * float(np.abs(sizes[trace.stage]).sum())


def _mismatches(form: PeakCounts | None, trace: HeldTrace | None,
                sizes: np.ndarray) -> list[str]:
    """How a closed form differs from the traced peak, in counts and in bytes."""
    if form is None or trace is None:
        return [] if form is None and trace is None else [f"form {form}, trace {trace}"]
    problems = []
    if form.peaks() != trace.peaks():
        problems.append(f"counts {form.peaks()} != traced {trace.peaks()}")
    if not np.allclose(form.peak_bytes(sizes), trace.peak_bytes(sizes), rtol=1e-12,
                       atol=_slack(trace, sizes)):
        problems.append(f"bytes {form.peak_bytes(sizes)} != {trace.peak_bytes(sizes)}")
    return problems


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(CLOSED_FORMS)), st.integers(1, 12), st.integers(1, 40), st.data())
def test_closed_form_peaks_equal_the_built_schedules_trace(name: str, p: int, m: int,
                                                            data: st.DataObject) -> None:
    v = _chunks(name, data)
    sizes = np.array(data.draw(st.lists(st.floats(0.0, 1e9), min_size=p * v, max_size=p * v),
                               label="bytes per stage"))
    assert _mismatches(closed_form_peaks(name, p, m, v), _trace(name, p, m, v), sizes) == []


def test_a_wrong_closed_form_is_caught() -> None:
    # planted: 1F1B priced with one microbatch more on every rank (gpipe's count where m = 2)
    sizes = np.arange(1.0, 5.0)
    wrong = PeakCounts((0, 1, 2, 3), np.array([min(4 - r + 1, 6) for r in range(4)], float))
    assert _mismatches(wrong, _trace("1f1b", 4, 6, 1), sizes)


def test_closed_forms_refuse_what_the_generator_refuses_as_too_large() -> None:
    p = m = int(np.sqrt(MAX_INSTRUCTIONS)) + 1
    assert closed_form_peaks("1f1b", p, m, 1) is None
    with pytest.raises(ValueError, match="instructions"):
        generate_schedule("1f1b", p, m, 1)


def test_schedules_without_a_closed_form_have_none() -> None:
    assert closed_form_peaks("zb-v", 4, 8, 2) is None
    assert closed_form_peaks("interleaved", 4, 8, 2) is None
    assert closed_form_peaks("gpipe", 4, 8, 2) is None  # a v gpipe refuses


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40))
def test_dualpipev_overlap_holds_what_dualpipev_holds(p: int, m: int) -> None:
    assert same_trace_as("dualpipev-overlap") == "dualpipev"
    plain, paired = _trace("dualpipev", p, m, 2), _trace("dualpipev-overlap", p, m, 2)
    if plain is None or paired is None:
        assert plain is None and paired is None
        return
    assert np.array_equal(plain.stage, paired.stage)
    assert np.array_equal(plain.delta, paired.delta)
    assert np.array_equal(plain.lengths, paired.lengths)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(_FIXED), st.integers(1, 10), st.integers(1, 30), st.data())
def test_every_schedule_holds_one_microbatch_of_each_of_a_ranks_stages_at_once(
        name: str, p: int, m: int, data: st.DataObject) -> None:
    # the search's memory floor (PlanContext.memory with floor=True) must never exceed a
    # real peak, or it would drop configurations that fit
    v = _chunks(name, data)
    trace = _trace(name, p, m, v)
    if trace is None:
        return
    sizes = np.array(data.draw(st.lists(st.floats(0.0, 1e9), min_size=p * v, max_size=p * v),
                               label="bytes per stage"))
    placement = SCHEDULES[name].placement(p, v)
    floor = np.bincount(placement, weights=sizes, minlength=p)
    assert (trace.peak_bytes(sizes) >= floor * (1 - 1e-12) - _slack(trace, sizes)).all()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(FUSED_BACKWARD)), st.integers(1, 10), st.integers(1, 30),
       st.data())
def test_fused_backward_schedules_emit_no_input_or_weight_gradient(
        name: str, p: int, m: int, data: st.DataObject) -> None:
    # the time bound prices these on fused costs, as the planner simulates them
    v = _chunks(name, data)
    kinds = {op.kind for stream in generate_schedule(name, p, m, v).streams for op in stream}
    assert kinds <= {Kind.F, Kind.B}


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([*sorted(WARM_UP_FORMS), "dualpipev-overlap"]), st.integers(1, 10),
       st.integers(1, 40), st.data())
def test_what_a_v_schedule_holds_at_its_first_release_never_exceeds_its_peak(
        name: str, p: int, m: int, data: st.DataObject) -> None:
    trace = _trace(name, p, m, 2)
    held = warm_up_held(name, p, m, 2)
    if trace is None:  # dualpipev refuses m < 2p, and so does the floor
        assert held is None
        return
    assert held is not None
    sizes = np.array(data.draw(st.lists(st.floats(0.0, 1e9), min_size=2 * p, max_size=2 * p),
                               label="bytes per stage"))
    assert (held.peak_bytes(sizes) <= trace.peak_bytes(sizes) + _slack(trace, sizes)).all()


def test_the_first_release_floor_is_above_one_of_each_stage() -> None:
    # not vacuous: zb-v's rank 0 runs 2p-1 chunk-0 forwards and one chunk-1 forward first
    held = warm_up_held("zb-v", 4, 8, 2)
    assert held is not None and held.peaks() == (8, 8, 8, 8) == _trace("zb-v", 4, 8, 2).peaks()
    assert warm_up_held("1f1b", 4, 8, 1) is None
