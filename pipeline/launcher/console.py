"""Standard output that may be closed, full or a closed pipe: the run goes on, its output is lost.

Why. What `pipesched` prints (a progress bar, a table) is a report of the run, not its result
(checkpoints, the output folder); a run must not fail because nobody can read the report.
Three ways stdout cannot take it:

- closed at start (``pipesched train >&-``): the kernel hands its number, 1, to the next file
  the process opens, and a rank's print would write into that file (or fail with EBADF);
- full (``> /dev/full``: ENOSPC) or broken (EIO), which surfaces at a flush in the middle of
  a command and used to end it as invalid input (exit 2);
- a pipe whose reader left (``| head -1``: EPIPE): the reader has what it wanted.

`guard_standard_streams` (the CLI's first step, and each rank's) puts /dev/null under a closed
0, 1 or 2 and wraps `sys.stdout` so that a failed write sends the rest of it to /dev/null,
with one warning on stderr (none for EPIPE; one for the command and its ranks together). The
exit code is the run's own.
"""

from __future__ import annotations

import errno
import io
import os
import sys
from typing import TextIO

__all__ = ["GuardedStdout", "discard_stdout", "guard_standard_streams"]

_WARNING = ("pipesched: warning: cannot write to standard output ({why}); the rest of it is "
            "discarded and the run goes on")


def discard_stdout() -> None:
    """Send what is still written to file descriptor 1 to /dev/null (the flush at exit
    must not fail again)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
    finally:
        os.close(devnull)


_WARNED = "PIPESCHED_STDOUT_WARNED"
"""Set once a process warned: its ranks (started later, same stdout) do not warn again."""


def _warn(why: str) -> None:
    if os.environ.get(_WARNED):
        return
    os.environ[_WARNED] = "1"
    try:
        print(_WARNING.format(why=why), file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass  # stderr is gone too: nothing left to tell


class GuardedStdout(io.TextIOBase):
    """`sys.stdout` whose first failed write or flush discards the rest (module docstring)."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self.discarding = False

    def write(self, text: str) -> int:
        if not self.discarding:
            try:
                self._stream.write(text)
            except OSError as error:
                self._give_up(error)
        return len(text)

    def flush(self) -> None:
        if not self.discarding:
            try:
                self._stream.flush()
            except OSError as error:
                self._give_up(error)

    def _give_up(self, error: OSError) -> None:
        self.discarding = True
        discard_stdout()
        try:  # what the failed write left buffered goes to /dev/null now
            self._stream.flush()
        except OSError:
            pass
        if error.errno != errno.EPIPE:
            _warn(error.strerror or type(error).__name__)

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return not self.discarding and self._stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding


def guard_standard_streams() -> None:
    """Reopen a closed fd 0, 1 or 2 on /dev/null (warning for 1) and guard `sys.stdout`."""
    closed_stdout = False
    for descriptor, flags in ((0, os.O_RDONLY), (1, os.O_WRONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(descriptor)
        except OSError:
            opened = os.open(os.devnull, flags)  # the lowest free number: this one
            if opened != descriptor:
                os.dup2(opened, descriptor)
                os.close(opened)
            closed_stdout = closed_stdout or descriptor == 1
            if descriptor == 2 and sys.stderr is None:
                sys.stderr = open(2, "w", closefd=False)
    if sys.stdout is None or closed_stdout:
        sys.stdout = open(1, "w", closefd=False)
    if closed_stdout:
        _warn("it is closed")
    if not isinstance(sys.stdout, GuardedStdout):
        sys.stdout = GuardedStdout(sys.stdout)
