"""Imported first by the fork server (a preload): deaf to Ctrl-C, and ended by the kernel
with its launcher.

The fork server imports torch before it serves anything (15-18 s on a loaded host), and only
notices its launcher is gone once it serves: a launcher killed meanwhile left it running
that long. With ``PR_SET_PDEATHSIG`` the kernel sends SIGKILL the moment the launcher dies.
Only when the launcher asked for it (`GUARD_ENV`, set while its main thread starts the fork
server): the signal follows the *thread* that started the process, and a worker thread
ending must not end a fork server the launcher still uses.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["GUARD_ENV"]

GUARD_ENV = "PIPESCHED_FORKSERVER_GUARD"
"""Set to the launcher's pid by the launcher while it starts the fork server."""

_PR_SET_PDEATHSIG = 1


def _guard() -> None:
    # The launcher started this process with SIGINT blocked (a Ctrl-C to the process group
    # must not end it with a traceback while it starts): ignore it for good, for the ranks
    # too (they inherit it), then unblock it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    launcher = os.environ.pop(GUARD_ENV, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return  # no prctl: the fork server ends when it next reads its closed pipe
    if os.getppid() != int(launcher):  # the launcher died before the signal was asked for
        os._exit(1)


if GUARD_ENV in os.environ:  # in the fork server only (the launcher imports GUARD_ENV)
    _guard()
