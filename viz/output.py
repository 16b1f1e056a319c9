"""Output files of the plots and traces: checking a path up front, making and saving figures."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "FIGURE_FORMATS",
    "TRACE_FORMATS",
    "OutputPathError",
    "check_output_path",
    "file_kind",
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


def file_kind(mode: int) -> str:
    """What a file of this `st_mode` is, in words, for messages refusing non-regular files."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file" if not stat.S_ISREG(mode) else "a regular file"


def _shown(path: Path) -> str:
    """The path quoted, shortened in the middle when too long to read on one line."""
    text = str(path)
    return repr(text) if len(text) <= 80 else repr(f"{text[:40]}...{text[-20:]}")


def _refused(path: Path, error: OSError) -> OutputPathError:
    reason = error.strerror or type(error).__name__
    if error.errno == errno.ENAMETOOLONG:
        longest = max((len(os.fsencode(part)) for part in path.parts), default=0)
        return OutputPathError(
            f"cannot write {_shown(path)}: {reason} (a name of {longest} bytes, "
            f"{len(os.fsencode(path))} in all); use a file name of at most 255 bytes")
    return OutputPathError(f"cannot write {_shown(path)}: {reason}; choose a path in a "
                           "directory you can write to")


def check_output_path(path: str | os.PathLike[str], formats: tuple[str, ...]) -> Path:
    """`path` as a `Path` once it is known to be writable and to end in one of `formats`.

    Checked by really opening the file (and removing it again when it did not exist), since
    permission bits say little to root or on read-only mounts. Only a regular file or a new
    name passes: opening a named pipe to write would block until something reads it.
    Raises `OutputPathError`.
    """
    target = Path(path)
    try:
        info: os.stat_result | None = os.stat(target)
    except (FileNotFoundError, NotADirectoryError):
        info = None
    except OSError as error:  # a name too long, a loop of links, no permission
        raise _refused(target, error) from None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise OutputPathError(f"cannot write {_shown(target)}: it is a directory; give a file "
                              f"name in it, such as {str(target / ('out.' + formats[0]))!r}")
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise OutputPathError(f"cannot write {_shown(target)}: it is {file_kind(info.st_mode)}, "
                              "not a regular file; give the path of a new or regular file")
    _format_of(target, formats)
    parent = target.parent
    if not parent.is_dir():
        raise OutputPathError(f"cannot write {_shown(target)}: the directory {_shown(parent)} "
                              "does not exist; create it first or choose another path")
    try:  # O_NONBLOCK: should a pipe appear here since the stat, the open still returns
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666))
    except OSError as error:
        raise _refused(target, error) from None
    if info is None:
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
