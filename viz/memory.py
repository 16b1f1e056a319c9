"""Memory plot: activations each rank holds over time, with every rank's peak marked."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from schedules import Kind, Timeline
from schedules.analysis.timeline import KIND_CODES
from viz.gantt import Margins
from viz.output import new_figure, save_figure
from viz.style import (
    KIND_COLOURS,
    format_bytes,
    rank_tick_step,
    row_inches,
    time_axis,
    use_byte_ticks,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PEAK_LABEL", "MemoryCurve", "in_flight", "plot_memory"]

PEAK_LABEL = "peak"
"""Label of the bar container of per-rank peaks (the right-hand panel)."""
Quantity = Literal["auto", "count", "bytes"]
_FILL = 0.84  # share of a row the global peak fills
_PEAK_PANEL = 2.2  # inches


@dataclass(frozen=True)
class MemoryCurve:
    """A rank's in-flight activations as a step function: `values[i]` from `times[i]` on."""

    rank: int
    times: np.ndarray
    values: np.ndarray

    @property
    def peak(self) -> float:
        return float(self.values.max()) if len(self.values) else 0.0

    @property
    def peak_time(self) -> float:
        """When the peak is first reached."""
        return float(self.times[int(np.argmax(self.values))]) if len(self.values) else 0.0


def in_flight(timeline: Timeline, *, in_bytes: bool = False) -> list[MemoryCurve]:
    """Per rank, the (stage, microbatch) activations held over time, counted or in bytes.

    Same count as `schedules.figures` (along each rank's order of ops): held from the start
    of F to the end of the last backward op of that stage and microbatch (B, or W when
    split), or the end of F when there is no backward. Events at one time are taken in the
    rank's order of ops, so ops that take no time still hold what they hold: an instant
    whose count rises and falls again is drawn as a spike to its highest value, then the
    value after it. Curves start at 0 at the first op.
    """
    p = timeline.num_ranks
    mask = timeline.compute_mask()
    rank, kind, stage = timeline.rank[mask], timeline.kind[mask], timeline.stage[mask]
    microbatch, start, end = timeline.microbatch[mask], timeline.start[mask], timeline.end[mask]
    if len(start) == 0:
        return [MemoryCurve(r, np.zeros(1), np.zeros(1)) for r in range(p)]
    # each op's place in its rank's order: by start, ties in row (stream) order
    place = np.empty(len(start))
    place[np.lexsort((np.arange(len(start)), start, rank))] = np.arange(len(start))
    key = (rank.astype(np.int64) * (int(stage.max()) + 1) + stage) * (
        int(microbatch.max()) + 1) + microbatch
    is_forward = kind == KIND_CODES[Kind.F]
    is_w = kind == KIND_CODES[Kind.W]
    frees = ~is_forward & ~((kind == KIND_CODES[Kind.I]) & np.isin(key, key[is_w]))
    release = np.full(int(key.max()) + 1, -np.inf)
    release_place = np.zeros(int(key.max()) + 1)
    order = np.argsort(end[frees], kind="stable")  # the last freeing op wins
    release[key[frees][order]] = end[frees][order]
    release_place[key[frees][order]] = place[frees][order]
    freed = release[key[is_forward]]
    freed_place = release_place[key[is_forward]]
    alone = ~np.isfinite(freed)  # no backward: gone when the F ends, right after it
    freed = np.where(alone, end[is_forward], freed)
    freed_place = np.where(alone, place[is_forward] + 0.5, freed_place)
    size = np.ones(int(is_forward.sum()))
    if in_bytes and timeline.activation_bytes:
        size = np.asarray(timeline.activation_bytes, dtype=np.float64)[stage[is_forward]]
    event_rank = np.concatenate([rank[is_forward], rank[is_forward]])
    event_time = np.concatenate([start[is_forward], freed])
    event_place = np.concatenate([place[is_forward], freed_place])
    delta = np.concatenate([size, -size])
    order = np.lexsort((event_place, event_time, event_rank))
    event_rank, event_time, delta = event_rank[order], event_time[order], delta[order]
    bounds = np.searchsorted(event_rank, np.arange(p + 1))
    first = float(start.min())
    curves = []
    for r in range(p):
        times = event_time[bounds[r]:bounds[r + 1]]
        running = np.round(np.cumsum(delta[bounds[r]:bounds[r + 1]]), 9)
        new_time = np.concatenate([[True], times[1:] != times[:-1]]) if len(times) else \
            np.zeros(0, dtype=bool)
        groups = np.flatnonzero(new_time)
        highest = np.maximum.reduceat(running, groups) if len(groups) else running
        after = running[np.append(groups[1:] - 1, len(running) - 1)] if len(groups) else \
            running
        spike = highest > after  # drawn as the highest value, then the value after it
        at = np.repeat(times[groups], 1 + spike)
        values = np.ravel(np.column_stack([highest, after]))[
            np.ravel(np.column_stack([np.ones(len(groups), bool), spike]))]
        curves.append(MemoryCurve(r, np.concatenate([[first], at]),
                                  np.concatenate([[0.0], values])))
    return curves


def plot_memory(timeline: Timeline, path: str | os.PathLike[str] | None = None, *,
                quantity: Quantity = "auto", title: str | None = None, width: float = 13.0,
                dpi: float = 100.0) -> Figure:
    """Activations in flight on each rank over time (one row per rank, rank 0 on top, rows
    scaled to the largest peak) with each peak marked, and a panel of per-rank peaks.

    `quantity` "auto" plots bytes when the timeline knows per-stage activation bytes.
    The peaks panel is `figure.axes[1]`, its bars the container labelled `PEAK_LABEL`.
    """
    if quantity not in ("auto", "count", "bytes"):
        raise ValueError(f"quantity must be 'auto', 'count' or 'bytes', got {quantity!r}")
    known_bytes = any(b > 0 for b in timeline.activation_bytes)
    if quantity == "bytes" and not known_bytes:
        raise ValueError("this timeline has no activation bytes per stage; simulate with "
                         "CostModel(activation_bytes=...) or plot quantity='count'")
    in_bytes = quantity == "bytes" or (quantity == "auto" and known_bytes)
    curves = in_flight(timeline, in_bytes=in_bytes)
    p = timeline.num_ranks
    margins = Margins(top=0.7)
    row = row_inches(p)
    height = margins.top + margins.bottom + row * p
    figure = new_figure(width, height, dpi)
    curve_width = width - margins.left - margins.right - _PEAK_PANEL - 0.35
    frame = (margins.bottom / height, row * p / height)
    ax = figure.add_axes((margins.left / width, frame[0], curve_width / width, frame[1]))
    peaks_ax = figure.add_axes(((width - margins.right - _PEAK_PANEL) / width, frame[0],
                                _PEAK_PANEL / width, frame[1]), sharey=ax)
    axis = time_axis(timeline)
    show: Callable[[float], str] = format_bytes if in_bytes else (lambda v: f"{v:g}")
    _draw_curves(ax, curves, axis.to_axis, row * 72.0)
    _draw_peaks(peaks_ax, curves, show, row * 72.0, in_bytes)
    ax.set_xlabel(f"time ({axis.unit})", fontsize=9)
    what = "activation bytes" if in_bytes else "activations (stage, microbatch)"
    peaks_ax.set_xlabel(f"peak {'bytes' if in_bytes else 'activations'}", fontsize=9)
    top = max(curves, key=lambda c: c.peak)
    ax.set_title(title or f"{timeline.name or 'timeline'}   p={p}  m={timeline.num_microbatches}"
                 f"  v={timeline.chunks}   {what} in flight per rank   most: rank {top.rank} "
                 f"holds {show(top.peak)}", loc="left", fontsize=10.5, pad=10)
    if path is not None:
        save_figure(figure, path, dpi)
    return figure


def _draw_curves(ax: Axes, curves: list[MemoryCurve], to_axis: Callable[[np.ndarray], np.ndarray],
                 row_points: float) -> None:
    scale = max(max(c.peak for c in curves), 1e-12)
    colour = KIND_COLOURS[Kind.F]
    for curve in curves:
        x = to_axis(curve.times)
        baseline = curve.rank + _FILL / 2
        level = baseline - _FILL * curve.values / scale
        ax.fill_between(x, baseline, level, step="post", color=colour, alpha=0.35, linewidth=0)
        ax.step(x, level, where="post", color=colour, linewidth=0.9)
        ax.axhline(baseline, color="0.8", linewidth=0.5, zorder=0)
        peak_x = to_axis(np.array([curve.peak_time]))
        ax.plot(peak_x, [baseline - _FILL * curve.peak / scale], marker="v", color="#c0392b",
                markersize=min(6.0, row_points * 0.3), linestyle="none", zorder=4)
    p = len(curves)
    ax.set_ylim(p - 0.5, -0.5)
    ticks = list(range(0, p, rank_tick_step(row_points)))
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"rank {r}" for r in ticks], fontsize=8)
    ax.tick_params(axis="y", length=0)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", color="0.88", linewidth=0.6)
    ax.margins(x=0.01)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _draw_peaks(ax: Axes, curves: list[MemoryCurve], show: Callable[[float], str],
                row_points: float, in_bytes: bool) -> None:
    peaks = np.array([c.peak for c in curves])
    colours = ["#c0392b" if v == peaks.max() else "0.6" for v in peaks.tolist()]
    ax.barh([c.rank for c in curves], peaks, height=0.7, color=colours, label=PEAK_LABEL)
    if row_points * 0.7 >= 7.0:
        for curve in curves:
            ax.text(curve.peak, curve.rank, f" {show(curve.peak)}",
                    va="center", fontsize=7.5, clip_on=False)
    ax.set_xlim(0, max(float(peaks.max()), 1e-12) * 1.3)
    if in_bytes:
        use_byte_ticks(ax.xaxis, float(peaks.max()) * 1.3, ticks=3)
    ax.tick_params(axis="y", labelleft=False, length=0)
    ax.tick_params(axis="x", labelsize=7.5)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
