"""Timeline (Gantt) plot: one row per rank, a bar per op at its real start and length."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from schedules import KINDS, Figures, Kind, Timeline, figures
from schedules.analysis.timeline import KIND_CODES
from schedules.ir.instructions import COMM_KINDS, COMPUTE_KINDS
from viz.bars import add_bars
from viz.output import new_figure, save_figure
from viz.style import (
    COMM_COLOUR,
    IDLE_EDGE,
    IDLE_FACE,
    KIND_COLOURS,
    KIND_LABELS,
    TimeAxis,
    chunk_of,
    op_colours,
    rank_tick_step,
    row_inches,
    shading_note,
    text_colours,
    time_axis,
)

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "BAR_HEIGHT",
    "GATHER_LABEL",
    "IDLE_LABEL",
    "REDUCE_LABEL",
    "Margins",
    "draw_timeline",
    "idle_gaps",
    "legend_handles",
    "plot_timeline",
    "timeline_title",
]

BAR_HEIGHT = 0.8
"""Height of a compute bar as a share of its rank's row."""
IDLE_LABEL = "idle"
"""Label of the bar container holding the bubbles (compute containers carry the kind)."""
_MAX_LABELS = 4000
"""Beyond this many fitting labels the text is dropped: unreadable, and slow to draw."""
_COMM_HEIGHT = 0.14
REDUCE_LABEL = "reduce"
"""Label of the bar container holding a simulated gradient reduction's buckets."""
_REDUCE_COLOUR = "#8e44ad"
_REDUCE_CODE = KIND_CODES[Kind.REDUCE_GRAD]
GATHER_LABEL = "gather"
"""Label of the bar container holding a simulated ZeRO-1 parameter gather's buckets (STEP
rows of a timeline with `gather_ends`)."""
_GATHER_COLOUR = "#16a085"
_GATHER_CODE = KIND_CODES[Kind.STEP]
ALL_TO_ALL_LABEL = "all-to-all"
"""Label of the bar container holding a simulated expert all-to-all's parts (ALL_TO_ALL rows,
`CostModel.all_to_all`)."""
_ALL_TO_ALL_COLOUR = "#d35400"
_ALL_TO_ALL_CODE = KIND_CODES[Kind.ALL_TO_ALL]
_ORDER = (Kind.F, Kind.B, Kind.OVERLAP_B, Kind.I, Kind.W)


@dataclass(frozen=True)
class Margins:
    """Space around the axes, in inches: room for the rank labels, title, legend, x label."""

    left: float = 0.85
    right: float = 0.3
    top: float = 0.8
    bottom: float = 0.55


def idle_gaps(timeline: Timeline) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per rank, (starts, ends) of the time with no compute op, between the first op of any
    rank and the last: the bubble. Overlapping ops (measured runs) are merged first."""
    mask = timeline.compute_mask()
    rank, start, end = timeline.rank[mask], timeline.start[mask], timeline.end[mask]
    gaps: list[tuple[np.ndarray, np.ndarray]] = []
    if len(start) == 0:
        return [(np.zeros(0), np.zeros(0)) for _ in range(timeline.num_ranks)]
    first, last = float(start.min()), float(end.max())
    for r in range(timeline.num_ranks):
        on_rank = rank == r
        order = np.argsort(start[on_rank], kind="stable")
        starts, ends = start[on_rank][order], end[on_rank][order]
        covered = np.maximum.accumulate(ends) if len(ends) else ends
        # a gap opens where an op starts after everything before it has ended
        gap_starts = np.concatenate([[first], covered])
        gap_ends = np.concatenate([starts, [last]])
        keep = gap_ends > gap_starts
        gaps.append((gap_starts[keep], gap_ends[keep]))
    return gaps


def timeline_title(timeline: Timeline, result: Figures, axis: TimeAxis) -> str:
    """Schedule, p, m, v, makespan, bubble rate and idle fraction on one line."""
    m = timeline.num_microbatches or (int(timeline.microbatch.max()) + 1 if len(timeline) else 0)
    parts = " and ".join(name for name, on in (("reduction", timeline.reduction_ends),
                                               ("gather", timeline.gather_ends)) if on)
    step = "" if result.step is None else \
        f"   step with {parts} {result.step * axis.scale:.4g} {axis.unit}"
    return (f"{timeline.name or 'timeline'}   p={timeline.num_ranks}  m={m}  "
            f"v={timeline.chunks}   makespan {result.makespan * axis.scale:.4g} {axis.unit}   "
            f"bubble rate {result.bubble_rate:.1%}   idle fraction {result.idle_fraction:.1%}"
            f"{step}")


def _bar_colours(timeline: Timeline, select: np.ndarray, kind: Kind) -> np.ndarray:
    m = timeline.num_microbatches or int(timeline.microbatch.max()) + 1
    return op_colours(kind, timeline.microbatch[select], chunk_of(timeline, select), m,
                      timeline.chunks)


def _draw_labels(ax: Axes, left: np.ndarray, width: np.ndarray, rank: np.ndarray,
                 microbatch: np.ndarray, colours: np.ndarray, points_per_unit: float,
                 row_points: float) -> int:
    """Write each microbatch number on its bar when it fits; returns how many were written."""
    bar_points = BAR_HEIGHT * row_points
    font = float(np.clip(bar_points * 0.6, 5.0, 8.5))
    if bar_points < font * 1.15:
        return 0
    texts = [str(x) for x in microbatch.tolist()]
    needed = np.array([len(t) for t in texts]) * 0.62 * font + 3.0
    fits = np.flatnonzero(width * points_per_unit >= needed)
    if len(fits) > _MAX_LABELS:
        return 0
    ink = text_colours(colours[fits]) if len(fits) else []
    for n, i in enumerate(fits.tolist()):
        ax.text(left[i] + width[i] / 2, rank[i], texts[i], ha="center", va="center",
                fontsize=font, color=ink[n], clip_on=True, zorder=4)
    return len(fits)


def draw_timeline(ax: Axes, timeline: Timeline, axis: TimeAxis, *, width_inches: float,
                  row_height_inches: float, x_range: tuple[float, float] | None = None,
                  show_comm: bool = False, rank_labels: bool = True) -> None:
    """Draw `timeline` into `ax`: one bar collection per compute kind (label "F", "B", ...;
    one rectangle per op, x = start, width = duration on `axis`; read back with
    `viz.bars.bar_extents`), one for the bubbles (label `IDLE_LABEL`), and thin marks for
    communication when `show_comm`."""
    p = timeline.num_ranks
    compute = timeline.compute_mask()
    if x_range is None:
        x_range = _default_range(timeline, axis)
    points_per_unit = width_inches * 72.0 / max(x_range[1] - x_range[0], 1e-12)
    row_points = row_height_inches * 72.0

    gaps = idle_gaps(timeline)
    gap_ranks = np.concatenate([np.full(len(s), r) for r, (s, _) in enumerate(gaps)])
    gap_starts = np.concatenate([s for s, _ in gaps])
    gap_ends = np.concatenate([e for _, e in gaps])
    add_bars(ax, gap_ranks, axis.to_axis(gap_starts), (gap_ends - gap_starts) * axis.scale,
             BAR_HEIGHT, IDLE_LABEL, facecolors=IDLE_FACE, edgecolors=IDLE_EDGE, hatch="////",
             linewidths=0.0, zorder=1)

    for kind in _ORDER:
        select = compute & (timeline.kind == KIND_CODES[kind])
        if not select.any():
            continue
        left = axis.to_axis(timeline.start[select])
        width = (timeline.end[select] - timeline.start[select]) * axis.scale
        colours = _bar_colours(timeline, select, kind)
        edges = float(np.median(width)) * points_per_unit >= 4.0  # white seams between ops
        add_bars(ax, timeline.rank[select], left, width, BAR_HEIGHT, kind.value,
                 facecolors=colours, edgecolors="white" if edges else colours,
                 linewidths=0.5 if edges else 0.3, zorder=3)
        _draw_labels(ax, left, width, timeline.rank[select], timeline.microbatch[select],
                     colours, points_per_unit, row_points)

    if timeline.reduction_ends or timeline.gather_ends or \
            (timeline.kind == _ALL_TO_ALL_CODE).any():
        _draw_reduction(ax, timeline, axis)
    if show_comm:
        _draw_comm(ax, timeline, axis)

    ax.set_xlim(*x_range)
    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top
    step = rank_tick_step(row_points)
    ticks = list(range(0, p, step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"rank {r}" for r in ticks] if rank_labels else [], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="0.85", linewidth=0.6, zorder=0)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _draw_reduction(ax: Axes, timeline: Timeline, axis: TimeAxis) -> None:
    """A simulated gradient reduction, parameter gather or expert all-to-all: its parts as a
    band along the top of each row (the rank's communication lane, under its compute)."""
    lanes = [(_REDUCE_CODE, REDUCE_LABEL, _REDUCE_COLOUR, timeline.reduction_ends),
             (_GATHER_CODE, GATHER_LABEL, _GATHER_COLOUR, timeline.gather_ends),
             (_ALL_TO_ALL_CODE, ALL_TO_ALL_LABEL, _ALL_TO_ALL_COLOUR, True)]
    for code, label, colour, present in lanes:
        select = timeline.kind == code
        if present and select.any():
            add_bars(ax, timeline.rank[select] - BAR_HEIGHT / 2 - _COMM_HEIGHT / 2,
                     axis.to_axis(timeline.start[select]),
                     (timeline.end[select] - timeline.start[select]) * axis.scale,
                     _COMM_HEIGHT * 1.4, label, facecolors=colour,
                     edgecolors="white", linewidths=0.4, alpha=0.9, zorder=5)


def _draw_comm(ax: Axes, timeline: Timeline, axis: TimeAxis) -> None:
    """Communication (and other non-compute ops) as thin marks along the bottom of each row."""
    comm_codes = [KIND_CODES[k] for k in COMM_KINDS]
    is_comm = np.isin(timeline.kind, comm_codes)
    other = ~is_comm & ~timeline.compute_mask()
    if timeline.reduction_ends:  # drawn on their own lane
        other &= timeline.kind != _REDUCE_CODE
    if timeline.gather_ends:
        other &= timeline.kind != _GATHER_CODE
    other &= timeline.kind != _ALL_TO_ALL_CODE
    for select, label, colour in ((is_comm, "comm", COMM_COLOUR), (other, "other", "#8e44ad")):
        if select.any():
            add_bars(ax, timeline.rank[select] + BAR_HEIGHT / 2 - _COMM_HEIGHT / 2,
                     axis.to_axis(timeline.start[select]),
                     (timeline.end[select] - timeline.start[select]) * axis.scale,
                     _COMM_HEIGHT, label, facecolors=colour, linewidths=0.0, alpha=0.85,
                     zorder=5)


def _default_range(timeline: Timeline, axis: TimeAxis) -> tuple[float, float]:
    if len(timeline) == 0:
        return (0.0, 1.0)
    low = min(0.0, float(axis.to_axis(timeline.start.min())))
    high = float(axis.to_axis(timeline.end.max()))
    return (low, high if high > low else low + 1.0)


def legend_handles(timeline: Timeline, show_comm: bool = False) -> list[Artist]:
    """Legend entries for the kinds present, the bubble, and communication when drawn."""
    from matplotlib.patches import Patch

    present = {KINDS[code] for code in np.unique(timeline.kind).tolist()}
    handles: list[Artist] = [Patch(facecolor=KIND_COLOURS[k], label=KIND_LABELS[k])
                             for k in _ORDER if k in present]
    handles.append(Patch(facecolor=IDLE_FACE, edgecolor=IDLE_EDGE, hatch="////",
                         label="idle (bubble)"))
    if show_comm and present & COMM_KINDS:
        handles.append(Patch(facecolor=COMM_COLOUR, label="comm"))
    if timeline.reduction_ends and Kind.REDUCE_GRAD in present:
        handles.append(Patch(facecolor=_REDUCE_COLOUR, label="gradient reduction (bucket)"))
        present = present - {Kind.REDUCE_GRAD}
    if timeline.gather_ends and Kind.STEP in present:
        handles.append(Patch(facecolor=_GATHER_COLOUR, label="parameter gather (bucket)"))
        present = present - {Kind.STEP}
    if show_comm and present - COMM_KINDS - COMPUTE_KINDS:
        handles.append(Patch(facecolor="#8e44ad", label="other"))
    return handles


def plot_timeline(timeline: Timeline, path: str | os.PathLike[str] | None = None, *,
                  show_comm: bool = False, title: str | None = None, width: float = 13.0,
                  dpi: float = 100.0) -> Figure:
    """Gantt chart of a simulated or measured timeline; saved as PNG/SVG when `path` is given.

    Bars sit at their real start and length in cost-model units, or in ms from the first op
    for a measured run (`unit` "s"). The title carries p, m, v, the bubble rate and idle
    fraction of `schedules.figures`. The figure is `width` × (rows-dependent) inches.
    """
    result = figures(timeline)
    axis = time_axis(timeline)
    margins = Margins()
    row = row_inches(timeline.num_ranks)
    height = margins.top + margins.bottom + row * timeline.num_ranks
    figure = new_figure(width, height, dpi)
    axes_width = width - margins.left - margins.right
    ax = figure.add_axes((margins.left / width, margins.bottom / height, axes_width / width,
                          row * timeline.num_ranks / height))
    draw_timeline(ax, timeline, axis, width_inches=axes_width, row_height_inches=row,
                  show_comm=show_comm)
    ax.set_xlabel(f"time ({axis.unit})", fontsize=9)
    ax.set_title(title or timeline_title(timeline, result, axis), loc="left", fontsize=10.5,
                 pad=20)
    ax.legend(handles=legend_handles(timeline, show_comm), loc="lower left",
              bbox_to_anchor=(0.0, 1.0), ncol=6, frameon=False, fontsize=8,
              borderaxespad=0.15, handlelength=1.4, columnspacing=1.2)
    figure.text((width - margins.right) / width, (height - margins.top + 0.06) / height,
                shading_note(timeline.chunks), ha="right", va="bottom", fontsize=7.5,
                color="0.4")
    if path is not None:
        save_figure(figure, path, dpi)
    return figure
