"""Imported last by the fork server (a preload): tells its launcher the imports are done.

The launcher waits for this with SIGINT and SIGTERM free (`processes.
_start_fork_server_deaf_to_ctrl_c`), then starts ranks with them held: the first rank's
start waits for the fork server's import of torch (15-18 s on a loaded host), and a kill
held through that wait left the launcher, its fork server and its ranks running as long.
"""

from __future__ import annotations

import os

__all__ = ["READY_ENV"]

READY_ENV = "PIPESCHED_FORKSERVER_READY"
"""Set by the launcher, while it starts the fork server, to a path this module creates."""


def _tell_launcher() -> None:
    path = os.environ.pop(READY_ENV, "")
    if path:
        try:
            with open(path, "x"):
                pass
        except OSError:
            pass  # the launcher's directory is gone: it stopped waiting


if READY_ENV in os.environ:  # in the fork server only (the launcher imports READY_ENV)
    _tell_launcher()
