"""Helpers shared by the viz tests: small timelines and image-file checks."""

from __future__ import annotations

import struct
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from schedules import CostModel, Kind, Span, Timeline, build_schedule, simulate

__all__ = ["measured_timeline", "png_size", "simulated", "svg_size_points"]


def simulated(name: str, p: int, m: int, v: int | None = None, **costs: float) -> Timeline:
    """A simulated timeline; per-rank costs split over v chunks like the CLI does."""
    schedule = build_schedule(name, p, m, v)
    c = schedule.chunks
    model = CostModel(forward=costs.get("forward", 1.0) / c,
                      backward=costs.get("backward", 1.0) / c,
                      weight=costs.get("weight", 1.0) / c, comm=costs.get("comm", 0.0),
                      activation_bytes=costs.get("activation_bytes", 0.0))
    return simulate(schedule, model)


def measured_timeline() -> Timeline:
    """Two ranks of a 'measured' run in seconds from an epoch far from 0, with send/recv."""
    t0 = 1_700_000_000.0
    ms = 1e-3
    spans = [
        Span(0, Kind.F, 0, 0, t0, t0 + 2 * ms), Span(0, Kind.SEND_F, 0, 0, t0 + 2 * ms,
                                                       t0 + 2.5 * ms),
        Span(1, Kind.RECV_F, 1, 0, t0 + 2 * ms, t0 + 2.6 * ms),
        Span(1, Kind.F, 1, 0, t0 + 2.6 * ms, t0 + 4.6 * ms),
        Span(1, Kind.B, 1, 0, t0 + 4.6 * ms, t0 + 8.6 * ms),
        Span(1, Kind.SEND_B, 1, 0, t0 + 8.6 * ms, t0 + 9.0 * ms),
        Span(0, Kind.RECV_B, 0, 0, t0 + 8.6 * ms, t0 + 9.1 * ms),
        Span(0, Kind.B, 0, 0, t0 + 9.1 * ms, t0 + 13.1 * ms),
        Span(0, Kind.STEP, -1, -1, t0 + 13.1 * ms, t0 + 13.5 * ms),
    ]
    return Timeline.from_spans(spans, 2, name="measured", num_microbatches=1, unit="s")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk; fails if it is not a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def svg_size_points(path: Path) -> tuple[float, float]:
    """(width, height) in points of an SVG's root element; fails if it is not SVG."""
    root = ElementTree.parse(path).getroot()
    assert root.tag.endswith("svg"), f"{path} is not an SVG"
    return (float(root.attrib["width"].removesuffix("pt")),
            float(root.attrib["height"].removesuffix("pt")))
