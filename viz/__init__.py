"""Plots and traces of pipeline timelines: Gantt, comparison, memory, partition, Perfetto JSON.

matplotlib is imported lazily inside the plot functions (on the Agg canvas, pyplot untouched),
and each submodule on first use of one of its names, so importing `viz` (or `viz.output`, to
check a path) is cheap. Every plot returns its `Figure` and saves it when given a path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from viz.bars import bar_extents, bars_labelled
    from viz.compare import TABLE_COLUMNS, comparison_table, plot_comparison
    from viz.curves import plot_training
    from viz.gantt import IDLE_LABEL, draw_timeline, idle_gaps, plot_timeline
    from viz.memory import PEAK_LABEL, MemoryCurve, in_flight, plot_memory
    from viz.output import (
        FIGURE_FORMATS,
        TRACE_FORMATS,
        OutputPathError,
        check_output_path,
        save_figure,
    )
    from viz.partition_plot import plot_partition
    from viz.trace_export import trace_events, write_trace

__all__ = [
    "FIGURE_FORMATS",
    "IDLE_LABEL",
    "PEAK_LABEL",
    "TABLE_COLUMNS",
    "TRACE_FORMATS",
    "MemoryCurve",
    "OutputPathError",
    "bar_extents",
    "bars_labelled",
    "check_output_path",
    "comparison_table",
    "draw_timeline",
    "idle_gaps",
    "in_flight",
    "plot_comparison",
    "plot_memory",
    "plot_partition",
    "plot_timeline",
    "plot_training",
    "save_figure",
    "trace_events",
    "write_trace",
]

_MODULE_OF = {  # public name -> the submodule that defines it
    "bar_extents": "viz.bars",
    "bars_labelled": "viz.bars",
    "TABLE_COLUMNS": "viz.compare",
    "comparison_table": "viz.compare",
    "plot_comparison": "viz.compare",
    "plot_training": "viz.curves",
    "IDLE_LABEL": "viz.gantt",
    "draw_timeline": "viz.gantt",
    "idle_gaps": "viz.gantt",
    "plot_timeline": "viz.gantt",
    "PEAK_LABEL": "viz.memory",
    "MemoryCurve": "viz.memory",
    "in_flight": "viz.memory",
    "plot_memory": "viz.memory",
    "FIGURE_FORMATS": "viz.output",
    "TRACE_FORMATS": "viz.output",
    "OutputPathError": "viz.output",
    "check_output_path": "viz.output",
    "save_figure": "viz.output",
    "plot_partition": "viz.partition_plot",
    "trace_events": "viz.trace_export",
    "write_trace": "viz.trace_export",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'viz' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
