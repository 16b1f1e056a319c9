"""Output files of the plots and traces: checking a path up front, making and saving figures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "FIGURE_FORMATS",
    "TRACE_FORMATS",
    "OutputPathError",
    "check_output_path",
    "new_figure",
    "save_figure",
]

FIGURE_FORMATS = ("png", "svg")
"""File suffixes the plots can be saved as."""
TRACE_FORMATS = ("json",)
"""File suffixes of a Chrome / Perfetto trace."""


class OutputPathError(ValueError):
    """An output path that cannot be written, or whose suffix names no format we write."""


def _format_of(path: Path, formats: tuple[str, ...]) -> str:
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        allowed = ", ".join(f".{f}" for f in formats)
        found = (f"{path.suffix!r} is not a format we write" if path.suffix
                 else "the name has no suffix to choose the format")
        raise OutputPathError(
            f"cannot write {str(path)!r}: {found}; end the file name with one of {allowed}")
    return suffix


def check_output_path(path: str | os.PathLike[str], formats: tuple[str, ...]) -> Path:
    """`path` as a `Path` once it is known to be writable and to end in one of `formats`.

    Checked by really opening the file (and removing it again when it did not exist), since
    permission bits say little to root or on read-only mounts. Raises `OutputPathError`.
    """
    target = Path(path)
    if target.is_dir():
        raise OutputPathError(f"cannot write {str(target)!r}: it is a directory; give a file "
                              f"name in it, such as {str(target / ('out.' + formats[0]))!r}")
    _format_of(target, formats)
    parent = target.parent
    if not parent.is_dir():
        raise OutputPathError(f"cannot write {str(target)!r}: the directory {str(parent)!r} "
                              "does not exist; create it first or choose another path")
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as error:
        reason = error.strerror or type(error).__name__
        raise OutputPathError(f"cannot write {str(target)!r}: {reason}; "
                              "choose a path in a directory you can write to") from None
    if not existed:
        target.unlink(missing_ok=True)
    return target


def new_figure(width: float, height: float, dpi: float = 100.0) -> Figure:
    """A matplotlib figure on the non-interactive Agg canvas, without touching pyplot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Figure, path: str | os.PathLike[str], dpi: float = 100.0) -> Path:
    """Save `figure` as PNG or SVG (chosen by the suffix); the image is figsize × dpi pixels."""
    target = Path(path)
    file_format = _format_of(target, FIGURE_FORMATS)
    metadata = {"Date": None} if file_format == "svg" else None  # reproducible SVG bytes
    figure.savefig(target, format=file_format, dpi=dpi, metadata=metadata)
    return target
