"""No orphans: every rank ends, and the launcher's temporary directories go, as soon as the
process that launched it is gone (SIGKILL, SIGTERM, SIGINT, a crash), whatever the rank is
doing at that moment.

Three mechanisms, because each alone misses a case:

- The kernel's parent-death signal (`die_with_parent`, Linux): SIGKILL the moment the rank's
  parent exits, even while its main thread is blocked in C holding the GIL (torch's
  ``FileStore(path, world_size)`` retries a removed rendezvous file for 300 s that way, and no
  Python thread of the rank runs meanwhile). Under the forkserver start method the parent
  is the fork server, which lives while any process holds its "alive" pipe, and every rank
  inherits a copy: the rank closes that copy, so the fork server ends with the launcher.
- A reaper process (`Reaper`, this file run as a script with only the standard library):
  started by the launcher before any rank, it waits for the launcher to exit and then kills
  the ranks it was told of and removes the launcher's directories, which a rank killed by
  the kernel can no longer do.
- A watch thread in each rank (`watch_launcher`), for where neither of the above exists
  (no prctl; torchrun's agent, whose directories are its own): a pidfd (Linux >= 5.3)
  becomes readable the moment the launcher exits; elsewhere the thread polls the pid,
  checking its start time so a recycled pid is not taken for the launcher.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import IO, Any, NamedTuple

__all__ = ["EXIT_LAUNCHER_GONE", "ProcessIdentity", "Reaper", "die_with_parent", "identity_of",
           "is_running", "remove_on_sigterm", "watch_launcher"]

EXIT_LAUNCHER_GONE = 4
"""Exit code of a rank that ended because its launcher was gone."""
_POLL = 0.2  # seconds between checks where no pidfd is available
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_REAPER_PATIENCE = 10.0  # seconds the reaper waits for killed ranks to go before removing


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


def is_running(launcher: ProcessIdentity) -> bool:
    """Whether `launcher` (that very process, not a later one with its pid) still runs."""
    if launcher.started is not None:
        return _start_time(launcher.pid) == launcher.started
    try:
        os.kill(launcher.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a process with that pid exists (not ours to signal)
    return True


def _pidfd(launcher: ProcessIdentity) -> int | None:
    """A descriptor readable once `launcher` exits (None without pidfd, or if it is gone)."""
    try:
        descriptor = os.pidfd_open(launcher.pid)
    except (AttributeError, OSError):
        return None
    if not is_running(launcher):  # the pidfd may be of a recycled pid
        os.close(descriptor)
        return None
    return descriptor


def _wait_for_exit(launcher: ProcessIdentity) -> None:
    """Block until the launcher has exited."""
    descriptor = _pidfd(launcher)
    if descriptor is not None:
        poller = select.poll()
        poller.register(descriptor, select.POLLIN)
        while not poller.poll():
            pass
        os.close(descriptor)
        return
    while is_running(launcher):
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


def die_with_parent(launcher: ProcessIdentity) -> None:
    """Have the kernel SIGKILL this rank when its parent exits (Linux; elsewhere nothing),
    close the inherited fork-server pipe that would keep that parent alive, and end now if
    the launcher is already gone (it may have died before the signal was asked for)."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # private: no public way to reach the pipe
    # A rank the fork server forked holds the launcher's "alive" pipe but no fork server of
    # its own (`_forkserver_pid` None): the pipe's only use would be to start processes
    # through the launcher's fork server, which a rank never does (it starts its own).
    if server._forkserver_pid is None and server._forkserver_alive_fd is not None:
        try:
            os.close(server._forkserver_alive_fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the watch thread and the reaper remain
    if not is_running(launcher):
        os._exit(EXIT_LAUNCHER_GONE)


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


class Reaper:
    """The launcher's side of the reaper process: tell it the ranks and directories to deal
    with if this process dies; `close` when the launcher has cleaned up after itself."""

    def __init__(self, directories: Sequence[str]) -> None:
        me = identity_of(os.getpid())
        # -I -S: the standard library only, fast; a session of its own, so that a Ctrl-C
        # on the terminal, which interrupts the launcher, leaves the reaper to clean up.
        # The directories on its command line: known to it from its start, even if this
        # process dies before the reaper has run a line of its own.
        self._process: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-I", "-S", os.path.abspath(__file__), str(me.pid),
             me.started or "", *directories], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, start_new_session=True)

    def watch(self, pid: int) -> None:
        """Kill process `pid` (checked by its start time) if the launcher dies."""
        self._tell(f"pid {pid} {_start_time(pid) or ''}")

    def close(self) -> None:
        """The launcher ended its ranks and removed its directories: the reaper may go."""
        if self._process is None:
            return
        self._tell("done")
        try:
            assert self._process.stdin is not None
            self._process.stdin.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def _tell(self, line: str) -> None:
        stream: IO[bytes] | None = None if self._process is None else self._process.stdin
        if stream is None:
            return
        try:
            stream.write(line.encode() + b"\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # the reaper is gone; the ranks' own mechanisms remain


def _reap(launcher: ProcessIdentity, directories: Sequence[str]) -> int:
    """The reaper's main: follow the launcher's instructions on stdin until it says "done",
    or until it exits, then kill its ranks and remove its `directories`."""
    for number in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(number, signal.SIG_IGN)
    ranks: list[ProcessIdentity] = []
    pending = b""
    stdin = sys.stdin.fileno()

    def follow(chunk: bytes) -> bool:
        """Take the complete lines read so far; whether one said "done"."""
        nonlocal pending
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            word, _, rest = line.decode().partition(" ")
            if word == "done":
                return True
            if word == "pid":
                pid, _, started = rest.partition(" ")
                ranks.append(ProcessIdentity(int(pid), started or None))
        return False

    descriptor = _pidfd(launcher)
    poller = select.poll()
    poller.register(stdin, select.POLLIN)
    if descriptor is not None:
        poller.register(descriptor, select.POLLIN)
    reading = True
    while is_running(launcher):
        events = poller.poll(None if descriptor is not None and reading else _POLL * 1000)
        if not reading or not any(fd == stdin for fd, _ in events):
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:  # EOF: the launcher closed its end or died (ranks may hold copies)
            reading = False
            poller.unregister(stdin)
            continue
        if follow(chunk):
            return 0
    # The launcher can die before this loop has read what it wrote (before this process
    # even started): a rank it named then outlived it. Read the rest now, without waiting
    # for an end of file, which never comes while ranks forked from the launcher hold copies.
    if reading and follow(_unread(stdin)):
        return 0
    for rank in ranks:
        if is_running(rank):
            try:
                os.kill(rank.pid, signal.SIGKILL)
            except OSError:
                pass
    deadline = time.monotonic() + _REAPER_PATIENCE
    while any(is_running(rank) for rank in ranks) and time.monotonic() < deadline:
        time.sleep(0.02)
    for path in directories:
        shutil.rmtree(path, ignore_errors=True)
    return 0


def _unread(descriptor: int) -> bytes:
    """What `descriptor` holds now, without waiting for more."""
    os.set_blocking(descriptor, False)
    data = b""
    while True:
        try:
            chunk = os.read(descriptor, 65536)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


if __name__ == "__main__":  # the reaper process `Reaper` starts
    sys.exit(_reap(ProcessIdentity(int(sys.argv[1]), sys.argv[2] or None), sys.argv[3:]))
