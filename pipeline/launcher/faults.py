"""Named fault points: tests arm one to crash this process at an exact moment.

Production code calls `reach(point)` at the few moments whose failure matters (between a
checkpoint's file writes, before its manifest, before the commit); nothing happens unless a
test armed that point in this process. A crash is simulated with SIGKILL (`kill_self`) or
an exception, so the on-disk state is exactly what a real crash there would leave.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

__all__ = ["FAULT_POINTS", "arm", "disarm_all", "kill_self", "reach"]

FAULT_POINTS = (
    "checkpoint.file",  # a file's bytes are in its temporary name, not yet renamed
    "checkpoint.manifest",  # every rank's files are in place; the manifest is not written
    "checkpoint.commit",  # the manifest is written; the directory is not yet renamed
    "checkpoint.swap",  # re-saving a step: the old copy is moved aside, the new not yet in
    "checkpoint.latest",  # the directory is committed; `latest` still names the old one
)
"""Where `reach` is called; `arm` refuses any other name."""

_armed: dict[str, tuple[int, Callable[[], None]]] = {}


def arm(point: str, action: Callable[[], None], *, skip: int = 0) -> None:
    """Run `action` the (`skip` + 1)-th time this process reaches `point`, then forget it."""
    if point not in FAULT_POINTS:
        raise ValueError(f"unknown fault point {point!r}; use one of {', '.join(FAULT_POINTS)}")
    if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
        raise ValueError(f"skip must be an int >= 0, got {skip!r}")
    _armed[point] = (skip, action)


def disarm_all() -> None:
    _armed.clear()


def reach(point: str) -> None:
    """Called by production code at `point`: fires the armed action, if any is due."""
    entry = _armed.get(point)
    if entry is None:
        return
    skip, action = entry
    if skip > 0:
        _armed[point] = (skip - 1, action)
        return
    del _armed[point]
    action()


def kill_self() -> None:
    """SIGKILL this process: no exception handler, `finally` or atexit runs, as in an OOM kill."""
    os.kill(os.getpid(), signal.SIGKILL)
