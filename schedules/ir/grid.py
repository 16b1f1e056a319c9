"""Render the rank × step grid around one step, for error messages."""

from __future__ import annotations

from collections.abc import Sequence

from schedules.ir.instructions import Instruction

__all__ = ["format_grid"]


def format_grid(streams: Sequence[Sequence[Instruction]], rank: int, step: int, *,
                width: int = 5, max_ranks: int = 16) -> str:
    """Steps step-width..step+width of every rank (at most `max_ranks` rows around `rank`),
    with the instruction at (`rank`, `step`) in brackets and `-` past a stream's end."""
    first = max(0, step - width)
    last = step + width
    low = max(0, min(rank - max_ranks // 2, len(streams) - max_ranks))
    rows = range(low, min(len(streams), low + max_ranks))
    cells: list[list[str]] = []
    for r in rows:
        row = []
        for k in range(first, last + 1):
            text = str(streams[r][k]) if k < len(streams[r]) else "-"
            row.append(f"[{text}]" if (r, k) == (rank, step) else text)
        cells.append(row)
    widths = [max(len(row[c]) for row in cells) for c in range(last - first + 1)]
    header = "step    " + " ".join(str(first + c).rjust(w) for c, w in enumerate(widths))
    lines = [header]
    for r, row in zip(rows, cells):
        marker = ">" if r == rank else " "
        lines.append(f"{marker}rank {r:<3}" + " ".join(x.rjust(w) for x, w in zip(row, widths)))
    return "\n".join(lines)
