"""A fork-server preload that never finishes importing: the fork server importing torch on a
loaded host, for as long as a test needs (`tests.support.orphan_job`'s ``importing`` point).
It marks the file named by `MARK_ENV` once the import has begun."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["MARK_ENV"]

MARK_ENV = "PIPESCHED_TEST_ENDLESS_IMPORT"
"""Set by the launcher to the file this module creates when the fork server imports it."""

if MARK_ENV in os.environ:  # in the fork server only (the launcher imports MARK_ENV)
    Path(os.environ.pop(MARK_ENV)).touch()
    while True:  # until the kernel kills it with its launcher
        time.sleep(3600)
