"""One peak count: every API counts a rank's activations from its stream, not from the clock.

Regression for issue 34, item 2. `figures().peak_activations` used to count from simulated
times with frees first at ties, so zero-cost ops (that all start at one instant) gave a
lower peak than the stream holds (zb-h1, p = 2, m = 2, everything free but stage 1's W:
(0, 2) against (2, 2)), and a forward-only schedule gave 1 (0 on a free rank) where the
stream counts gave v·m. The definition, written here from the docs: walking a rank's
stream, F takes one (stage, microbatch) activation, its last backward op (B or
OVERLAP_B, or W when the backward is split, I when no W follows) frees it; an F with no
backward op (inference) holds its activation only while it runs. The peak is the most
held just after any F.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import (
    SCHEDULES,
    CostModel,
    Instruction,
    Kind,
    Schedule,
    figures,
    generate_schedule,
    lower,
    simulate,
)
from schedules.analysis.accounting import held_peaks
from schedules.analysis.memory import MemoryModel, predict_memory
from schedules.search.candidates import peak_in_flight

__all__: list[str] = []

# zb-optimal needs a solver and seconds per case: its peaks are checked in test_zb_optimal
NAMES = sorted(name for name in SCHEDULES if name != "zb-optimal")


def oracle_peaks(streams: Sequence[Sequence[Instruction]]) -> tuple[int, ...]:
    """The definition above, one op at a time."""
    peaks = []
    for stream in streams:
        ops = [(op.kind, op.stage, op.microbatch) for op in stream]
        split = {(s, i) for kind, s, i in ops if kind is Kind.W}
        freed_by = {(s, i) for kind, s, i in ops
                    if kind in (Kind.B, Kind.OVERLAP_B, Kind.W) or
                    (kind is Kind.I and (s, i) not in split)}
        held = peak = 0
        for kind, s, i in ops:
            if kind is Kind.F:
                peak = max(peak, held + 1)
                held += (s, i) in freed_by
            elif kind in (Kind.B, Kind.OVERLAP_B, Kind.W) or (
                    kind is Kind.I and (s, i) not in split):
                held -= 1
        peaks.append(peak)
    return tuple(peaks)


def every_count(schedule: Schedule, costs: CostModel) -> dict[str, tuple[int, ...]]:
    counts = {
        "figures": figures(simulate(schedule, costs)).peak_activations,
        "held_peaks": held_peaks(schedule),
        "predict_memory": tuple(r.peak_in_flight for r in predict_memory(
            schedule, MemoryModel(saved=1.0))),
        "predict_memory (no bytes)": tuple(r.peak_in_flight for r in predict_memory(
            schedule, MemoryModel())),
        "oracle": oracle_peaks(schedule.compute_streams()),
    }
    lowered = lower(schedule)
    counts["figures, lowered"] = figures(simulate(lowered, costs)).peak_activations
    counts["held_peaks, lowered"] = held_peaks(lowered)
    return counts


def test_zero_cost_ops_do_not_lower_the_figures_peak() -> None:
    schedule = generate_schedule("zb-h1", 2, 2)
    costs = CostModel(forward=0.0, backward=0.0, weight=[0.0, 1.0])
    assert figures(simulate(schedule, costs)).peak_activations == (2, 2)
    assert len(set(every_count(schedule, costs).values())) == 1


def test_forward_only_holds_one_activation_at_a_time_in_every_api() -> None:
    schedule = generate_schedule("forward-only", 2, 3, 2)
    for costs in (CostModel(), CostModel(forward=[0.0, 1.0, 0.0, 1.0])):
        counts = every_count(schedule, costs)
        assert set(counts.values()) == {(1, 1)}, counts
    assert peak_in_flight(schedule.streams) == 1


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(NAMES), p=st.integers(1, 8), m=st.integers(1, 16),
       v=st.integers(1, 4), data=st.data())
def test_every_peak_api_agrees_with_zero_costs(name: str, p: int, m: int, v: int,
                                               data: st.DataObject) -> None:
    low, high = SCHEDULES[name].chunks
    chunks = min(max(v, low), high if high is not None else v)
    try:
        schedule = generate_schedule(name, p, m, chunks)
    except ValueError:
        return  # a schedule that refuses these sizes
    stages = schedule.num_stages
    free = st.lists(st.sampled_from([0.0, 0.0, 1.0, 2.5]), min_size=stages, max_size=stages)
    costs = CostModel(forward=data.draw(free), backward=data.draw(free),
                      weight=data.draw(free), comm=data.draw(st.sampled_from([0.0, 1.0])))
    counts = every_count(schedule, costs)
    assert len(set(counts.values())) == 1, counts
    assert peak_in_flight(schedule.streams) == max(counts["oracle"])


@pytest.mark.parametrize("name", NAMES)
def test_every_peak_api_agrees_when_everything_is_free(name: str) -> None:
    low, _ = SCHEDULES[name].chunks
    p, m = (3, 6)
    schedule = generate_schedule(name, p, m, max(low, SCHEDULES[name].default_chunks))
    counts = every_count(schedule, CostModel(forward=0.0, backward=0.0, weight=0.0))
    assert len(set(counts.values())) == 1, counts
