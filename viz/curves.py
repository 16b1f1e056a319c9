"""Training curves of a run: loss and step time per step."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from viz.output import FIGURE_FORMATS, check_output_path, new_figure, save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_training"]


def plot_training(losses: Sequence[float], step_seconds: Sequence[float],
                  path: str | os.PathLike[str] | None = None, *, title: str = "training",
                  dpi: float = 100.0) -> Figure:
    """Loss (left axis) and step time in ms (right axis) against the step number."""
    if len(losses) != len(step_seconds) or not losses:
        raise ValueError(f"need one step time per loss and at least one step, got "
                         f"{len(losses)} losses and {len(step_seconds)} step times")
    if path is not None:
        check_output_path(path, FIGURE_FORMATS)
    figure = new_figure(8.0, 3.6, dpi)
    loss_axis = figure.add_subplot(1, 1, 1)
    steps = range(1, len(losses) + 1)
    loss_axis.plot(steps, losses, color="#3572b0", marker="o", markersize=3, label="loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss", color="#3572b0")
    time_axis = loss_axis.twinx()
    time_axis.plot(steps, [1000 * s for s in step_seconds], color="#e07b2a", linewidth=1,
                   alpha=0.8, label="step time")
    time_axis.set_ylabel("step time (ms)", color="#e07b2a")
    time_axis.set_ylim(bottom=0)
    loss_axis.set_title(title, loc="left")
    loss_axis.spines["top"].set_visible(False)
    time_axis.spines["top"].set_visible(False)
    figure.tight_layout()
    if path is not None:
        save_figure(figure, path, dpi)
    return figure
