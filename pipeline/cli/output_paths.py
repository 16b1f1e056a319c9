"""argparse types for output files: checked writable up front, so a bad path fails in a blink."""

from __future__ import annotations

import argparse
from pathlib import Path

from viz.output import FIGURE_FORMATS, TRACE_FORMATS, OutputPathError, check_output_path

__all__ = ["figure_path", "trace_path", "writable_path"]


def writable_path(text: str, formats: tuple[str, ...]) -> Path:
    """`text` as a Path we can write with a suffix in `formats`, or an argparse error naming it."""
    try:
        return check_output_path(text, formats)
    except OutputPathError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def figure_path(text: str) -> Path:
    """argparse type of a --plot style option: a writable .png or .svg file."""
    return writable_path(text, FIGURE_FORMATS)


def trace_path(text: str) -> Path:
    """argparse type of a --trace option: a writable .json file."""
    return writable_path(text, TRACE_FORMATS)
