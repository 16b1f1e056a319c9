"""Comparison plot: several schedules' timelines on one shared time axis, with their figures."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from schedules import Figures, Timeline, figures
from viz.gantt import Margins, draw_timeline, legend_handles
from viz.output import new_figure, save_figure
from viz.style import format_bytes, row_inches, shading_note, time_axis

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["TABLE_COLUMNS", "comparison_table", "plot_comparison"]

TABLE_COLUMNS = ("schedule", "v", "makespan", "bubble rate", "idle fraction",
                 "peak activations", "peak bytes")
"""Header of `comparison_table`; "peak ..." are the largest over ranks (rank 0 for 1F1B);
peak activations of a v-chunk schedule are written "count × 1/v" (each is 1/v of a stage)."""
_PANEL_TITLE = 0.32  # inches above each panel for its name
_TABLE_ROW = 0.24  # inches per table row


def comparison_table(timelines: Sequence[Timeline],
                     results: Sequence[Figures] | None = None) -> list[tuple[str, ...]]:
    """One row of text per timeline under `TABLE_COLUMNS` (peak bytes "-" when unknown)."""
    results = results if results is not None else [figures(t) for t in timelines]
    rows: list[tuple[str, ...]] = []
    for timeline, result in zip(timelines, results):
        scale, unit = time_axis(timeline).scale, time_axis(timeline).unit
        peak_bytes = max(result.peak_activation_bytes, default=0.0)
        rows.append((timeline.name or "timeline", str(timeline.chunks),
                     f"{result.makespan * scale:.4g} {unit}", f"{result.bubble_rate:.1%}",
                     f"{result.idle_fraction:.1%}",
                     _activations(max(result.peak_activations, default=0), timeline.chunks),
                     format_bytes(peak_bytes) if peak_bytes else "-"))
    return rows


def _activations(count: int, chunks: int) -> str:
    """A peak count of (stage, microbatch) activations; with v chunks each is 1/v of a stage
    (the same layers split v ways), so "8 × 1/2" holds what 4 whole stages' do."""
    return str(count) if chunks == 1 else f"{count} × 1/{chunks}"


def _check(timelines: Sequence[Timeline]) -> None:
    if not timelines:
        raise ValueError("plot_comparison needs at least one timeline; pass a list of them")
    units = {time_axis(t).unit for t in timelines}
    if len(units) > 1:
        raise ValueError(f"cannot share one time axis between units {sorted(units)}; "
                         "compare simulated with simulated and measured with measured runs")


def plot_comparison(timelines: Sequence[Timeline], path: str | os.PathLike[str] | None = None,
                    *, title: str | None = None, width: float = 13.0,
                    dpi: float = 100.0) -> Figure:
    """Timelines stacked top to bottom on one shared time axis, each panel's makespan marked,
    and a table of their figures below; saved as PNG/SVG when `path` is given.

    Panel k (from the top) is `figure.axes[k]`, drawn by `draw_timeline`; the table is in
    the last axes. Meant for schedules of the same p, m and costs.
    """
    _check(timelines)
    results = [figures(t) for t in timelines]
    axes_list = [time_axis(t) for t in timelines]
    x_high = max(max(float(a.to_axis(t.end.max())) for t, a in zip(timelines, axes_list)
                     if len(t)), 1e-9) if any(len(t) for t in timelines) else 1.0
    x_range = (0.0, x_high * 1.005)
    best = min(r.makespan * a.scale for r, a in zip(results, axes_list))

    margins = Margins(top=0.75, bottom=0.5)
    row = row_inches(sum(t.num_ranks for t in timelines))
    panel_heights = [row * t.num_ranks for t in timelines]
    table_height = _TABLE_ROW * (len(timelines) + 1) + 0.35
    height = (margins.top + sum(h + _PANEL_TITLE for h in panel_heights) + margins.bottom
              + table_height)
    figure = new_figure(width, height, dpi)
    axes_width = width - margins.left - margins.right

    top = height - margins.top
    panels: list[Axes] = []
    for timeline, result, axis, panel_height in zip(timelines, results, axes_list,
                                                    panel_heights):
        top -= _PANEL_TITLE + panel_height
        ax = figure.add_axes((margins.left / width, top / height, axes_width / width,
                              panel_height / height), sharex=panels[0] if panels else None)
        draw_timeline(ax, timeline, axis, width_inches=axes_width, row_height_inches=row,
                      x_range=x_range)
        makespan = result.makespan * axis.scale
        ax.set_title(f"{timeline.name or 'timeline'}  (v={timeline.chunks})   makespan "
                     f"{makespan:.4g} {axis.unit}   bubble rate {result.bubble_rate:.1%}",
                     loc="left", fontsize=9.5, pad=4)
        ax.axvline(makespan, color="#c0392b", linestyle="--", linewidth=1.1, zorder=6)
        if makespan > best:
            ax.axvline(best, color="0.35", linestyle=":", linewidth=1.0, zorder=6)
        panels.append(ax)
    for ax in panels[:-1]:
        ax.tick_params(axis="x", labelbottom=False)
    panels[-1].set_xlabel(f"time ({axes_list[0].unit})", fontsize=9)

    p_values = sorted({t.num_ranks for t in timelines})
    m_values = sorted({t.num_microbatches for t in timelines})
    figure.text(margins.left / width, 1 - 0.2 / height,
                title or f"schedules compared   p={'/'.join(map(str, p_values))}  "
                         f"m={'/'.join(map(str, m_values))}   (red dashes: makespan; "
                         "dots: the shortest)", fontsize=10.5, va="top")
    figure.legend(handles=legend_handles(_union_kinds(timelines)), loc="upper right",
                  bbox_to_anchor=(1 - margins.right / width, 1 - 0.42 / height), ncol=6,
                  frameon=False, fontsize=8, handlelength=1.4, columnspacing=1.2)
    figure.text(1 - margins.right / width, 1 - 0.2 / height,
                shading_note(max(t.chunks for t in timelines)), fontsize=7.5, color="0.4",
                ha="right", va="top")
    _draw_table(figure, timelines, results, margins, width, height, table_height)
    if path is not None:
        save_figure(figure, path, dpi)
    return figure


def _union_kinds(timelines: Sequence[Timeline]) -> Timeline:
    """A stand-in timeline holding every kind present in any of `timelines` (for the legend)."""
    import numpy as np

    kinds = np.unique(np.concatenate([t.kind for t in timelines]))
    zeros = np.zeros(len(kinds))
    return Timeline(1, zeros, kinds, zeros, zeros, zeros, zeros)


def _draw_table(figure: Figure, timelines: Sequence[Timeline], results: Sequence[Figures],
                margins: Margins, width: float, height: float, table_height: float) -> None:
    from matplotlib.transforms import Bbox

    rows = comparison_table(timelines, results)
    table_ax = figure.add_axes((margins.left / width, 0.1 / height,
                                min(9.0, width - margins.left - margins.right) / width,
                                (table_height - 0.35) / height))
    table_ax.set_axis_off()
    table = table_ax.table(cellText=[list(r) for r in rows], colLabels=list(TABLE_COLUMNS),
                           cellLoc="center", colLoc="center", loc="upper left",
                           bbox=Bbox.from_bounds(0.0, 0.0, 1.0, 1.0))
    table.auto_set_font_size(False)
    table.set_fontsize(8.5)
    for (row, _), cell in table.get_celld().items():
        cell.set_edgecolor("0.8")
        if row == 0:
            cell.set_facecolor("0.93")
            cell.get_text().set_fontweight("bold")
