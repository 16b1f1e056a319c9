"""Shared look of the plots: colours per op kind, microbatch shading, the time axis, sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from schedules import Kind, Timeline

if TYPE_CHECKING:
    from matplotlib.axis import Axis

__all__ = [
    "COMM_COLOUR",
    "IDLE_EDGE",
    "IDLE_FACE",
    "KIND_COLOURS",
    "KIND_LABELS",
    "TimeAxis",
    "chunk_of",
    "format_bytes",
    "op_colours",
    "rank_tick_step",
    "row_inches",
    "shading_note",
    "text_colours",
    "time_axis",
    "use_byte_ticks",
]

KIND_COLOURS: dict[Kind, tuple[float, float, float]] = {
    Kind.F: (0.216, 0.447, 0.706),  # blue
    Kind.B: (0.902, 0.459, 0.137),  # orange
    Kind.I: (0.776, 0.247, 0.259),  # red
    Kind.W: (0.251, 0.600, 0.286),  # green
    Kind.OVERLAP_B: (0.588, 0.294, 0.553),  # purple: a B overlapped with the F before it
}
KIND_LABELS: dict[Kind, str] = {
    Kind.F: "F forward", Kind.B: "B backward", Kind.I: "I input grad", Kind.W: "W weight grad",
    Kind.OVERLAP_B: "B overlapped with the F before it",
}
IDLE_FACE = (0.955, 0.955, 0.955)
IDLE_EDGE = (0.70, 0.70, 0.70)
COMM_COLOUR = (0.25, 0.25, 0.25)

_LIGHTEST = 0.55
"""How far toward white the last microbatch is shaded (0: not at all, 1: white)."""
_DARKEST_CHUNK = 0.35
"""How far toward black the last chunk of an interleaved rank is shaded."""


@dataclass(frozen=True)
class TimeAxis:
    """How timeline times map to the x axis: x = (t - origin) × scale."""

    origin: float
    scale: float
    unit: str
    """Label of the axis unit: "units" or "ms"."""

    def to_axis(self, times: np.ndarray) -> np.ndarray:
        return (np.asarray(times, dtype=np.float64) - self.origin) * self.scale


def time_axis(timeline: Timeline) -> TimeAxis:
    """Cost-model units as they are; a measured run (unit "s") in ms from its first op."""
    if timeline.unit == "s":
        origin = float(timeline.start.min()) if len(timeline) else 0.0
        return TimeAxis(origin, 1e3, "ms")
    return TimeAxis(0.0, 1.0, timeline.unit or "units")


def chunk_of(timeline: Timeline, mask: np.ndarray) -> np.ndarray:
    """Chunk index (0..v-1) of each selected op: the rank of its stage among the rank's stages."""
    rank, stage = timeline.rank[mask], timeline.stage[mask]
    if timeline.chunks <= 1 or len(stage) == 0:
        return np.zeros(len(stage), dtype=np.int64)
    width = int(stage.max()) + 1
    pairs = np.unique(rank.astype(np.int64) * width + stage)
    pair_rank = pairs // width
    # index of each (rank, stage) pair among those of the same rank: position - first position
    first = np.searchsorted(pair_rank, pair_rank)
    chunk_by_pair = np.arange(len(pairs)) - first
    return chunk_by_pair[np.searchsorted(pairs, rank.astype(np.int64) * width + stage)]


def op_colours(kind: Kind, microbatch: np.ndarray, chunk: np.ndarray, num_microbatches: int,
               chunks: int) -> np.ndarray:
    """RGB rows for ops of one kind: darker for later chunks, lighter for later microbatches."""
    base = np.asarray(KIND_COLOURS.get(kind, COMM_COLOUR), dtype=np.float64)
    dark = chunk / max(chunks - 1, 1) * _DARKEST_CHUNK if chunks > 1 else np.zeros(len(chunk))
    light = np.clip(microbatch, 0, None) / max(num_microbatches - 1, 1) * _LIGHTEST
    colours = base[None, :] * (1.0 - dark[:, None])
    return colours + (1.0 - colours) * light[:, None]


def text_colours(colours: np.ndarray) -> list[str]:
    """Black or white text, whichever reads better on each background colour."""
    luminance = colours @ np.array([0.299, 0.587, 0.114])
    return ["black" if y > 0.6 else "white" for y in luminance.tolist()]


def row_inches(num_rows: int) -> float:
    """Height of one rank row: roomy for a few ranks, ≥ 0.2 in up to 64 ranks."""
    if num_rows <= 8:
        return 0.45
    return min(0.45 * num_rows, 3.6 + 0.17 * (num_rows - 8)) / num_rows


def rank_tick_step(row_points: float, font_points: float = 8.0) -> int:
    """Label every k-th rank so that tick labels never overlap."""
    return max(1, math.ceil(font_points * 1.25 / max(row_points, 1e-9)))


def format_bytes(value: float) -> str:
    """Bytes with a binary prefix: 1536 -> '1.5 KiB'."""
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for prefix in ("Ki", "Mi", "Gi"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.3g} {prefix}B"
    return f"{value / 1024:.3g} TiB"


def use_byte_ticks(axis: Axis, high: float, ticks: int = 4) -> None:
    """Put about `ticks` ticks at round multiples of a binary unit (e.g. 0.5 GiB) on `axis`."""
    from matplotlib.ticker import FuncFormatter, MultipleLocator

    unit = 1024.0 ** max(0, math.floor(math.log(max(high, 1.0), 1024)))
    raw = high / unit / ticks
    magnitude = 10.0 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next((f * magnitude for f in (1, 2, 2.5, 5, 10) if f * magnitude >= raw), raw)
    axis.set_major_locator(MultipleLocator(step * unit))
    axis.set_major_formatter(FuncFormatter(lambda value, _: format_bytes(value)))


def shading_note(chunks: int) -> str:
    """The key to `op_colours` shading, for a corner of the legend."""
    return "shade: lighter = later microbatch" + (", darker = later chunk" if chunks > 1 else "")
