"""Partition plot: per-stage cost bars (compute + communication) and memory, bottleneck marked."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from schedules import Kind
from viz.output import new_figure, save_figure
from viz.style import KIND_COLOURS, format_bytes, use_byte_ticks

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_partition"]

_COMM_COLOUR = (0.62, 0.62, 0.62)
_MEMORY_COLOUR = (0.42, 0.32, 0.62)
_BOTTLENECK = "#c0392b"


def _checked(name: str, values: Sequence[float] | None, p: int) -> list[float]:
    if values is None or len(values) == 0:
        return [0.0] * p
    numbers = [float(v) for v in values]
    if len(numbers) != p:
        raise ValueError(f"{name} has {len(numbers)} values but compute has {p}; "
                         "give one number per stage")
    bad = [v for v in numbers if not math.isfinite(v) or v < 0]
    if bad:
        raise ValueError(f"{name} values must be finite and >= 0, got {bad[0]!r}")
    return numbers


def plot_partition(compute: Sequence[float], comm: Sequence[float] | None = None,
                   memory: Sequence[float] | None = None, *,
                   names: Sequence[str] | None = None, memory_cap: float | None = None,
                   unit: str = "s", title: str | None = None,
                   path: str | os.PathLike[str] | None = None, dpi: float = 100.0) -> Figure:
    """Per-stage time as stacked bars (compute, then communication on top), the mean and the
    bottleneck stage marked; below, per-stage memory bytes against `memory_cap` if given.

    Takes plain numbers, one per stage, so any partition result can be drawn, e.g.
    ``plot_partition(part.compute, part.comm, part.memory, memory_cap=part.memory_cap)``.
    Bars are containers labelled "compute", "comm" and "memory" on `figure.axes`.
    """
    p = len(compute)
    if p == 0:
        raise ValueError("plot_partition needs at least one stage; compute is empty")
    computes = _checked("compute", compute, p)
    comms = _checked("comm", comm, p)
    memories = _checked("memory", memory, p) if memory is not None and len(memory) else None
    labels = [str(n) for n in names] if names else [str(s) for s in range(p)]
    if len(labels) != p:
        raise ValueError(f"names has {len(labels)} entries for {p} stages; give one per stage")

    width = max(6.0, min(16.0, 1.6 + 0.34 * p))
    long_names = max(len(s) for s in labels) > 4 or p > 24
    label_room = 0.25 + (0.07 * min(max(len(s) for s in labels), 24) if long_names else 0.0)
    panel = 2.6
    height = 0.75 + panel + 0.45 + label_room + ((panel * 0.75 + 0.45) if memories else 0.0)
    figure = new_figure(width, height, dpi)
    left, right = 0.85 / width, 1 - 0.25 / width
    bottom = (label_room + 0.3) / height
    if memories:
        memory_ax = figure.add_axes((left, bottom, right - left, panel * 0.75 / height))
        bottom += (panel * 0.75 + 0.45) / height
    cost_ax = figure.add_axes((left, bottom, right - left, panel / height))

    costs = [c + m for c, m in zip(computes, comms)]
    worst = max(range(p), key=costs.__getitem__)
    mean = sum(costs) / p
    _draw_costs(cost_ax, computes, comms, worst, mean, unit)
    tick_axes = memory_ax if memories else cost_ax
    if memories:
        _draw_memory(memory_ax, memories, memory_cap)
        cost_ax.tick_params(axis="x", labelbottom=False)
    step = max(1, math.ceil(p / 64))
    for ax in (cost_ax, tick_axes):
        ax.set_xticks(range(0, p, step))
    tick_axes.set_xticklabels(labels[::step], fontsize=7.5, rotation=60 if long_names else 0,
                              ha="right" if long_names else "center")
    tick_axes.set_xlabel("stage", fontsize=9)
    imbalance = costs[worst] / mean if mean > 0 else 1.0
    cost_ax.set_title(title or f"partition   p={p}   bottleneck {costs[worst]:.4g} {unit} "
                               f"(stage {worst})   imbalance {imbalance:.3f}×",
                      loc="left", fontsize=10.5, pad=18)
    if path is not None:
        save_figure(figure, path, dpi)
    return figure


def _draw_costs(ax: Axes, compute: list[float], comm: list[float], worst: int, mean: float,
                unit: str) -> None:
    stages = list(range(len(compute)))
    handles = [ax.bar(stages, compute, width=0.75, color=KIND_COLOURS[Kind.F],
                      label="compute")]
    comm_bars = ax.bar(stages, comm, width=0.75, bottom=compute, color=_COMM_COLOUR,
                       label="comm")
    if any(comm):
        handles.append(comm_bars)
    ax.bar([worst], [compute[worst] + comm[worst]], width=0.75, fill=False,
           edgecolor=_BOTTLENECK, linewidth=1.6, label="_bottleneck")
    mean_line = ax.axhline(mean, color="0.25", linestyle="--", linewidth=0.9,
                           label="mean stage time")
    top = compute[worst] + comm[worst]
    ax.annotate("bottleneck", (worst, top), xytext=(0, 3), textcoords="offset points",
                ha="center", va="bottom", fontsize=7.5, color=_BOTTLENECK)
    ax.set_ylim(0, max(top, 1e-12) * 1.18)
    ax.set_xlim(-0.6, len(compute) - 0.4)
    ax.set_ylabel(f"time per microbatch ({unit})", fontsize=8.5)
    ax.tick_params(labelsize=7.5)
    ax.legend(handles=[*handles, mean_line], fontsize=7.5, frameon=False, loc="lower left",
              bbox_to_anchor=(0.0, 1.0), ncol=3, borderaxespad=0.1)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _draw_memory(ax: Axes, memory: list[float], cap: float | None) -> None:
    stages = list(range(len(memory)))
    over = [cap is not None and m > cap for m in memory]
    ax.bar(stages, memory, width=0.75, label="memory",
           color=[_BOTTLENECK if o else _MEMORY_COLOUR for o in over])
    if cap is not None:
        ax.axhline(cap, color=_BOTTLENECK, linestyle="--", linewidth=0.9)
        ax.annotate(f"cap {format_bytes(cap)}", (1.0, cap), xycoords=("axes fraction", "data"),
                    xytext=(0, 2), textcoords="offset points", ha="right", va="bottom",
                    fontsize=7.5, color=_BOTTLENECK)
    high = max(max(memory), cap or 0.0, 1e-12)
    ax.set_ylim(0, high * 1.15)
    ax.set_xlim(-0.6, len(memory) - 0.4)
    use_byte_ticks(ax.yaxis, high)
    ax.set_ylabel("memory", fontsize=8.5)
    ax.tick_params(labelsize=7.5)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
