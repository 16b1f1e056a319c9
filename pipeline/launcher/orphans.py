"""No orphans: a rank ends itself, and removes the launcher's temporary directories, as soon
as the process that launched it is gone (SIGKILL, SIGTERM, a crash).

Why not the parent-death signal alone: under the forkserver start method a rank's parent is
the fork server, not the launcher, and every rank holds the write end of the fork server's
"alive" pipe, so the fork server outlives a killed launcher for as long as the ranks do
(and they for as long as it does). Each rank therefore watches the launcher itself: a
pidfd (Linux >= 5.3) becomes readable the moment it exits; elsewhere the rank polls the
pid, checking its start time so a recycled pid is not taken for the launcher.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import NamedTuple

__all__ = ["EXIT_LAUNCHER_GONE", "ProcessIdentity", "identity_of", "remove_on_sigterm",
           "watch_launcher"]

EXIT_LAUNCHER_GONE = 4
"""Exit code of a rank that ended because its launcher was gone."""
_POLL = 0.2  # seconds between checks where no pidfd is available


class ProcessIdentity(NamedTuple):
    """A process as the kernel knows it: pid, and its start time (None where /proc is
    missing), which tells the process from a later one given the same pid."""

    pid: int
    started: str | None


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); None if no such live process."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    state, started = fields[0], fields[19]  # fields after "pid (comm)": state is field 3
    return None if state in ("Z", "X") else started


def identity_of(pid: int) -> ProcessIdentity:
    return ProcessIdentity(pid, _start_time(pid))


def _alive(launcher: ProcessIdentity) -> bool:
    if launcher.started is not None:
        return _start_time(launcher.pid) == launcher.started
    try:
        os.kill(launcher.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a process with that pid exists (not ours to signal)
    return True


def _wait_for_exit(launcher: ProcessIdentity) -> None:
    """Block until the launcher has exited."""
    try:
        descriptor = os.pidfd_open(launcher.pid)
    except (AttributeError, OSError):
        descriptor = None
    if descriptor is not None:
        if _alive(launcher):  # the pidfd is of the launcher, not of a recycled pid
            poller = select.poll()
            poller.register(descriptor, select.POLLIN)
            while not poller.poll():
                pass
        os.close(descriptor)
        return
    while _alive(launcher):
        time.sleep(_POLL)


def _end(launcher: ProcessIdentity, cleanup: Sequence[str]) -> None:
    _wait_for_exit(launcher)
    for path in cleanup:  # every rank tries; the last one leaves nothing behind
        shutil.rmtree(path, ignore_errors=True)
    try:
        print(f"[pipesched] rank process {os.getpid()} ending: its launcher "
              f"(pid {launcher.pid}) is gone", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # stderr went with the launcher's terminal
    os._exit(EXIT_LAUNCHER_GONE)  # the main thread may be blocked in a receive forever


def watch_launcher(launcher: ProcessIdentity, cleanup: Sequence[str] = ()) -> None:
    """End this process (after removing the `cleanup` directories) once `launcher` exits;
    returns at once (a daemon thread watches)."""
    threading.Thread(target=_end, args=(launcher, tuple(cleanup)), name="pipesched-launcher-watch",
                     daemon=True).start()


@contextmanager
def remove_on_sigterm(paths: Sequence[str]) -> Iterator[None]:
    """While inside, a SIGTERM (torchrun's agent stopping its workers) first removes `paths`,
    then ends the process by the signal as before. Only where SIGTERM has its default
    action and we are on the main thread (the only one Python signal handlers run on)."""
    if not paths or threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def remove_then_die(number: int, frame: FrameType | None) -> None:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, remove_then_die)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
