"""Gantt plot: one bar per compute op at its start and length, bubbles, title, files, sizes."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from schedules import KINDS, Kind, Timeline, figures
from schedules.ir.instructions import COMPUTE_KINDS
from tests.support.viz_helpers import measured_timeline, png_size, simulated, svg_size_points
from viz import IDLE_LABEL, OutputPathError, bar_extents, bars_labelled, plot_timeline

if TYPE_CHECKING:  # matplotlib is imported where a test draws, not while collecting
    from matplotlib.axes import Axes


def drawn_ops(ax: Axes) -> list[tuple[int, str, float, float]]:
    """(rank, kind, start, duration) of every compute bar, sorted."""
    ops = []
    for kind in ("F", "B", "I", "W"):
        for bars in bars_labelled(ax, kind):
            left, width, y = bar_extents(bars)
            ops += [(round(r), kind, x, w) for r, x, w in zip(y, left, width)]
    return sorted(ops)


def expected_ops(timeline: Timeline, scale: float = 1.0,
                 origin: float = 0.0) -> list[tuple[int, str, float, float]]:
    return sorted((s.rank, s.kind.value, (s.start - origin) * scale, (s.end - s.start) * scale)
                  for s in timeline.spans() if s.kind in COMPUTE_KINDS)


def assert_same_ops(drawn: list[tuple[int, str, float, float]],
                    expected: list[tuple[int, str, float, float]]) -> None:
    """Same bars (rank, kind) at the same start and duration, to float tolerance."""
    assert len(drawn) == len(expected)
    for (r, k, x, w), (er, ek, ex, ew) in zip(drawn, expected):
        assert (r, k) == (er, ek)
        assert x == pytest.approx(ex) and w == pytest.approx(ew)


@pytest.mark.parametrize(("name", "v"), [("1f1b", None), ("interleaved", 2), ("gpipe", None)])
def test_one_bar_per_compute_op_at_its_start_and_duration(name: str, v: int | None) -> None:
    timeline = simulated(name, 4, 8, v)
    ax = plot_timeline(timeline).axes[0]
    drawn, expected = drawn_ops(ax), expected_ops(timeline)
    assert len(expected) == int(timeline.compute_mask().sum())
    assert_same_ops(drawn, expected)


def test_title_carries_the_simulators_bubble_rate_and_idle_fraction() -> None:
    timeline = simulated("1f1b", 4, 8)
    result = figures(timeline)
    title = plot_timeline(timeline).axes[0].get_title(loc="left")
    assert f"bubble rate {result.bubble_rate:.1%}" in title
    assert f"idle fraction {result.idle_fraction:.1%}" in title
    assert "p=4" in title and "m=8" in title and "v=1" in title and "1f1b" in title


def test_idle_bars_add_up_to_the_idle_fraction() -> None:
    timeline = simulated("interleaved", 4, 8, 2, comm=0.25)
    result = figures(timeline)
    ax = plot_timeline(timeline).axes[0]
    (idle,) = bars_labelled(ax, IDLE_LABEL)
    idle_time = bar_extents(idle)[1].sum()
    assert idle_time / (timeline.num_ranks * result.makespan) == pytest.approx(
        result.idle_fraction)


def test_microbatch_labels_never_overlap_and_are_dropped_when_bars_are_thin() -> None:
    small = plot_timeline(simulated("interleaved", 4, 8, 2))
    ax = small.axes[0]
    assert len(ax.texts) > 0
    small.canvas.draw()
    renderer = small.canvas.get_renderer()
    boxes = sorted(((t.get_position()[1], t.get_window_extent(renderer)) for t in ax.texts),
                   key=lambda item: (item[0], item[1].x0))
    for (row, box), (next_row, next_box) in itertools.pairwise(boxes):
        if row == next_row:
            assert box.x1 <= next_box.x0
    big = plot_timeline(simulated("1f1b", 16, 64))
    assert len(big.axes[0].texts) == 0


def test_png_and_svg_have_the_figure_size(tmp_path: Path) -> None:
    timeline = simulated("1f1b", 4, 8)
    figure = plot_timeline(timeline, tmp_path / "t.png", dpi=80)
    width, height = figure.get_size_inches()
    assert png_size(tmp_path / "t.png") == (round(width * 80), round(height * 80))
    plot_timeline(timeline, tmp_path / "t.svg")
    assert svg_size_points(tmp_path / "t.svg") == pytest.approx((width * 72, height * 72))


@pytest.mark.parametrize("p", [2, 64])
def test_sizes_stay_sensible_from_2_to_64_ranks(p: int) -> None:
    figure = plot_timeline(simulated("1f1b", p, 4))
    _width, height = figure.get_size_inches()
    ax = figure.axes[0]
    row_inches = ax.get_position().height * height / p
    assert 2.0 <= height <= 16.0
    assert row_inches >= 0.2
    assert len(ax.get_yticks()) == p  # every rank labelled, rows tall enough for 8 pt


def test_measured_run_in_ms_from_its_first_op_with_comm_marks() -> None:
    timeline = measured_timeline()
    origin = float(timeline.start.min())
    figure = plot_timeline(timeline, show_comm=True)
    ax = figure.axes[0]
    assert ax.get_xlabel() == "time (ms)"
    assert_same_ops(drawn_ops(ax), expected_ops(timeline, 1e3, origin))
    comm_codes = [KINDS.index(k) for k in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)]
    (comm,) = bars_labelled(ax, "comm")
    assert len(comm.get_paths()) == int(np.isin(timeline.kind, comm_codes).sum())
    assert len(bars_labelled(ax, "other")) == 1  # the optimizer step
    assert bars_labelled(plot_timeline(timeline).axes[0], "comm") == []


def test_unknown_suffix_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OutputPathError, match=r"\.png, \.svg"):
        plot_timeline(simulated("1f1b", 2, 2), tmp_path / "t.pdf")
