"""The planner's input files (model and cluster JSON), read bounded: no module of the planner
is imported here, so every reader of a file can use it without an import circle."""

from __future__ import annotations

import os
from typing import Any

from pipeline.files import UnreadableInputError, read_json_file
from pipeline.planner.errors import PlanError

__all__ = ["MAX_INPUT_BYTES", "read_input_json"]

MAX_INPUT_BYTES = 64 << 20
"""The largest model or cluster JSON file the planner reads (a cost file of 200,000 layers
is about 15 MB)."""


def read_input_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON document of an input file, as a `PlanError` naming `what` if it cannot be
    read: refused without blocking or filling memory (a FIFO, /dev/zero, a huge file)."""
    try:
        return read_json_file(path, MAX_INPUT_BYTES)
    except UnreadableInputError as error:
        raise PlanError(f"{what} {error}") from None
    except OSError as error:
        raise PlanError(f"{what} {os.fspath(path)!r}: {error.strerror or error}") from None
