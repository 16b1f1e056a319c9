"""Named fault points: a test arms one on a `FaultPoints` to crash at an exact moment.

Production code calls `points.reach(name)` at the few moments whose failure matters (between
a checkpoint's file writes, before its manifest, before the commit) on the `FaultPoints` its
owner holds (the engine's `faults`, or a `CheckpointParts.faults`); nothing happens unless a
test armed that point on that object. A crash is simulated with SIGKILL (`kill_self`) or an
exception, so the on-disk state is exactly what a real crash there would leave.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

__all__ = ["FAULT_POINTS", "FaultPoints", "kill_self"]

FAULT_POINTS = (
    "checkpoint.staging",  # rank 0 made the staging directory; it is not opened yet
    "checkpoint.file",  # a file's bytes are in its temporary name, not yet renamed
    "checkpoint.manifest",  # every rank's files are in place; the manifest is not written
    "checkpoint.commit",  # the manifest is written; the directory is not yet renamed
    "checkpoint.swap",  # re-saving a step: the old copy is moved aside, the new not yet in
    "checkpoint.latest",  # the directory is committed; `latest` still names the old one
)
"""Where `reach` is called; `arm` refuses any other name."""


class FaultPoints:
    """The armed fault points of one owner (an engine, one save): name -> (skip, action)."""

    def __init__(self) -> None:
        self._armed: dict[str, tuple[int, Callable[[], None]]] = {}

    def arm(self, point: str, action: Callable[[], None], *, skip: int = 0) -> None:
        """Run `action` the (`skip` + 1)-th time `point` is reached, then forget it."""
        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; use one of "
                             f"{', '.join(FAULT_POINTS)}")
        if isinstance(skip, bool) or not isinstance(skip, int) or skip < 0:
            raise ValueError(f"skip must be an int >= 0, got {skip!r}")
        if not callable(action):
            raise TypeError(f"action must be callable (e.g. kill_self), got {action!r}")
        self._armed[point] = (skip, action)

    def disarm_all(self) -> None:
        self._armed.clear()

    @property
    def armed(self) -> tuple[str, ...]:
        """The points that will still fire."""
        return tuple(self._armed)

    def reach(self, point: str) -> None:
        """Called by production code at `point`: fires the armed action, if any is due."""
        entry = self._armed.get(point)
        if entry is None:
            return
        skip, action = entry
        if skip > 0:
            self._armed[point] = (skip - 1, action)
            return
        del self._armed[point]
        action()


def kill_self() -> None:
    """SIGKILL this process: no exception handler, `finally` or atexit runs, as in an OOM kill."""
    os.kill(os.getpid(), signal.SIGKILL)
