"""Plots and traces of pipeline timelines: Gantt, comparison, memory, partition, Perfetto JSON.

matplotlib is imported lazily inside the plot functions, so importing `viz` is cheap.
"""

from viz.compare import comparison_table, plot_comparison
from viz.gantt import draw_timeline, idle_gaps, plot_timeline
from viz.output import FIGURE_FORMATS, TRACE_FORMATS, OutputPathError, check_output_path

__all__ = [
    "FIGURE_FORMATS",
    "TRACE_FORMATS",
    "OutputPathError",
    "check_output_path",
    "comparison_table",
    "draw_timeline",
    "idle_gaps",
    "plot_comparison",
    "plot_timeline",
]
