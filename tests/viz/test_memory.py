"""Memory plot: in-flight activations per rank agree with the simulator's peaks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import figures
from tests.support.viz_helpers import png_size, simulated, svg_size_points
from viz import PEAK_LABEL, in_flight, plot_memory


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved", "forward-only"]),
       p=st.integers(1, 5), m=st.integers(1, 9), comm=st.sampled_from([0.0, 0.3]))
def test_curve_peaks_are_the_simulators_peaks(name: str, p: int, m: int, comm: float) -> None:
    timeline = simulated(name, p, m, comm=comm, activation_bytes=3.0)
    result = figures(timeline)
    assert [c.peak for c in in_flight(timeline)] == list(result.peak_activations)
    assert [c.peak for c in in_flight(timeline, in_bytes=True)] == pytest.approx(
        result.peak_activation_bytes)
    assert all(c.values[-1] == 0 for c in in_flight(timeline))  # everything freed at the end


def test_rank_0_holds_the_most_under_1f1b_and_the_plot_says_so(tmp_path: Path) -> None:
    timeline = simulated("1f1b", 4, 8)
    figure = plot_memory(timeline, tmp_path / "m.png")
    (peaks,) = [c for c in figure.axes[1].containers if c.get_label() == PEAK_LABEL]
    widths = [bar.get_width() for bar in peaks]
    assert widths == [4, 3, 2, 1]
    assert "most: rank 0 holds 4" in figure.axes[0].get_title(loc="left")
    markers = [line for line in figure.axes[0].lines if line.get_marker() == "v"]
    assert len(markers) == 4  # every rank's peak marked
    width, height = figure.get_size_inches()
    assert png_size(tmp_path / "m.png") == (round(width * 100), round(height * 100))


def test_bytes_when_known_and_svg(tmp_path: Path) -> None:
    timeline = simulated("interleaved", 4, 8, 2, activation_bytes=2.0**20)
    figure = plot_memory(timeline, tmp_path / "m.svg")
    assert "bytes" in figure.axes[0].get_title(loc="left")
    assert "MiB" in figure.axes[0].get_title(loc="left")
    width, height = figure.get_size_inches()
    assert svg_size_points(tmp_path / "m.svg") == pytest.approx((width * 72, height * 72))


def test_bytes_asked_for_but_unknown_is_an_error() -> None:
    with pytest.raises(ValueError, match="activation_bytes"):
        plot_memory(simulated("1f1b", 2, 2), quantity="bytes")


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(["zb-h1", "1f1b", "zb-v", "forward-only"]), p=st.integers(1, 4),
       m=st.integers(1, 6), free=st.lists(st.booleans(), min_size=8, max_size=8))
def test_curve_peaks_follow_the_stream_when_ops_take_no_time(name: str, p: int, m: int,
                                                             free: list[bool]) -> None:
    # issue 34: ops of zero cost start together, yet still run (and hold) in stream order
    from schedules import CostModel, generate_schedule, simulate
    schedule = generate_schedule(name, p, m)
    cost = [0.0 if free[s % 8] else 1.0 for s in range(schedule.num_stages)]
    timeline = simulate(schedule, CostModel(forward=cost, backward=cost, weight=cost))
    assert [c.peak for c in in_flight(timeline)] == list(figures(timeline).peak_activations)
