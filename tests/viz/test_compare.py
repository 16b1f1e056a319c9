"""Comparison plot: stacked timelines on one time axis, with a table of their figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from schedules import Kind, figures
from tests.support.viz_helpers import measured_timeline, png_size, simulated, svg_size_points
from viz import bar_extents, bars_labelled, comparison_table, plot_comparison


def three() -> list:
    return [simulated("gpipe", 4, 8), simulated("1f1b", 4, 8),
            simulated("interleaved", 4, 8, 2)]


def test_one_panel_per_schedule_sharing_the_time_axis_with_all_ops_drawn() -> None:
    timelines = three()
    figure = plot_comparison(timelines)
    panels = figure.axes[:3]
    assert len({ax.get_xlim() for ax in panels}) == 1
    assert panels[0].get_xlim()[1] >= max(figures(t).makespan for t in timelines)
    for ax, timeline in zip(panels, timelines):
        drawn = sum(len(bar_extents(bars)[0]) for kind in (Kind.F, Kind.B)
                    for bars in bars_labelled(ax, kind.value))
        assert drawn == int(timeline.compute_mask().sum())
        assert f"bubble rate {figures(timeline).bubble_rate:.1%}" in ax.get_title(loc="left")
        assert timeline.name in ax.get_title(loc="left")


def test_table_holds_makespan_bubble_and_peak_activations_per_schedule() -> None:
    timelines = three()
    rows = comparison_table(timelines)
    assert [r[0] for r in rows] == ["gpipe", "1f1b", "interleaved"]
    assert rows[1][2] == f"{figures(timelines[1]).makespan:.4g} units"
    assert rows[0][5] == "8" and rows[1][5] == "4"  # GPipe holds m, 1F1B holds p on rank 0
    # interleaved (v = 2): each activation is half a stage's, said in the cell
    assert rows[2][5] == f"{max(figures(timelines[2]).peak_activations)} × 1/2"
    table = plot_comparison(timelines).axes[-1].tables[0]
    cells = table.get_celld()
    for r, row in enumerate(rows, start=1):
        assert [cells[r, c].get_text().get_text() for c in range(len(row))] == list(row)


def test_png_and_svg_files(tmp_path: Path) -> None:
    figure = plot_comparison(three(), tmp_path / "c.png")
    width, height = figure.get_size_inches()
    assert png_size(tmp_path / "c.png") == (round(width * 100), round(height * 100))
    plot_comparison(three(), tmp_path / "c.svg")
    assert svg_size_points(tmp_path / "c.svg") == pytest.approx((width * 72, height * 72))


def test_refuses_nothing_and_mixed_time_units() -> None:
    with pytest.raises(ValueError, match="at least one"):
        plot_comparison([])
    with pytest.raises(ValueError, match="one time axis"):
        plot_comparison([simulated("1f1b", 2, 2), measured_timeline()])
