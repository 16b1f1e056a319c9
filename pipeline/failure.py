"""Stop every rank when one fails: a failure record in the rendezvous store and a watchdog.

A rank that fails writes one record (rank, instruction, message) to the process group's
store. Every rank runs a watchdog thread that polls the store; when it sees another
rank's record it reports it and ends the process, so no rank waits forever in a receive
whose sender is gone. A rank that simply stalls is caught by the process-group timeout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["EXIT_PEER_FAILED", "FailureRecord", "Watchdog", "read_failure", "report_failure",
           "start_watchdog", "stop_watchdog"]

EXIT_PEER_FAILED = 3
"""Exit code of a rank stopped because another rank failed."""
_FIRST_KEY = "pipesched/failure/first"
_COUNT_KEY = "pipesched/failure/count"


@dataclass(frozen=True)
class FailureRecord:
    """Who failed, where, and why."""

    rank: int
    instruction: str | None
    message: str

    def describe(self) -> str:
        where = f" at instruction {self.instruction}" if self.instruction else ""
        return f"rank {self.rank} failed{where}: {self.message}"


def _store() -> Any:
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def report_failure(rank: int, instruction: str | None, message: str) -> None:
    """Record this rank's failure; the first record written is the one every rank sees."""
    store = _store()
    if store is None:
        return
    try:
        if store.add(_COUNT_KEY, 1) == 1:
            store.set(_FIRST_KEY, json.dumps({"rank": rank, "instruction": instruction,
                                              "message": message[:4000]}))
    except RuntimeError:
        pass  # the store is gone (the job is ending): nothing left to tell


def read_failure() -> FailureRecord | None:
    """The first failure recorded in this job, if any."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.check([_FIRST_KEY]):
            return None
        raw = json.loads(store.get(_FIRST_KEY))
    except RuntimeError:
        return None
    return FailureRecord(int(raw["rank"]), raw["instruction"], str(raw["message"]))


class Watchdog:
    """Polls the store every `interval` seconds; calls `on_peer_failure` once when another
    rank's failure appears (by default: print it and end this process)."""

    def __init__(self, rank: int, interval: float = 0.1,
                 on_peer_failure: Callable[[FailureRecord], None] | None = None) -> None:
        self.rank = rank
        self.interval = interval
        self.on_peer_failure = on_peer_failure or _exit_on_peer_failure(rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipesched-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            record = read_failure()
            if record is not None and record.rank != self.rank:
                self.on_peer_failure(record)
                return


def _exit_on_peer_failure(rank: int) -> Callable[[FailureRecord], None]:
    def stop(record: FailureRecord) -> None:
        print(f"[pipesched] rank {rank} stopping: {record.describe()}", file=sys.stderr,
              flush=True)
        os._exit(EXIT_PEER_FAILED)  # the main thread may be blocked in a receive forever
    return stop


_watchdog: Watchdog | None = None


def start_watchdog(rank: int, on_peer_failure: Callable[[FailureRecord], None] | None = None,
                   interval: float = 0.1) -> None:
    """Start this process's watchdog unless one runs already (needs a process group)."""
    global _watchdog
    if _watchdog is not None or _store() is None:
        return
    _watchdog = Watchdog(rank, interval, on_peer_failure)
    _watchdog.start()


def stop_watchdog() -> None:
    """Stop this process's watchdog (before the process group is destroyed)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
