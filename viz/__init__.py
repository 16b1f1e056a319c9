"""Plots and traces of pipeline timelines: Gantt, comparison, memory, partition, Perfetto JSON.

matplotlib is imported lazily inside the plot functions (on the Agg canvas, pyplot untouched),
so importing `viz` is cheap. Every plot returns its `Figure` and saves it when given a path.
"""

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
