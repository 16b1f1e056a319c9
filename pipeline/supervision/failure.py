"""Stop every rank when one fails: a failure record in the rendezvous store and a watchdog.

A rank that fails writes one record (rank, instruction, message) to the process group's
store; a rank that timed out writes the record of the rank it names as stalled. Every rank
runs a `Watchdog` thread, owned by whoever started it (the launcher for its rank, the engine
for itself), that polls the store: when it sees a record another rank wrote, it reports it
and ends the process, so no rank waits forever in a receive whose sender is gone. An
engine's watchdog also answers stall probes from its `ProgressRecord`.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from pipeline.supervision.progress import (
    ProgressRecord,
    answer_probes,
    bounded,
    default_store,
    probes_sent,
)

__all__ = ["EXIT_PEER_FAILED", "FailureRecord", "Watchdog", "read_failure", "report_failure"]

EXIT_PEER_FAILED = 3
"""Exit code of a rank stopped because another rank failed."""
_FIRST_KEY = "pipesched/failure/first"
_COUNT_KEY = "pipesched/failure/count"
_STORE_PATIENCE = 5.0  # seconds a failure path waits on the store before giving up on it


@dataclass(frozen=True)
class FailureRecord:
    """Who failed, where, and why; `reporter` is the rank that wrote it (another rank when
    it names a rank that stalled)."""

    rank: int
    instruction: str | None
    message: str
    reporter: int

    def describe(self) -> str:
        where = f" at instruction {self.instruction}" if self.instruction else ""
        told = "" if self.reporter == self.rank else f" (reported by rank {self.reporter})"
        return f"rank {self.rank} failed{where}{told}: {self.message}"


def report_failure(rank: int, instruction: str | None, message: str, *,
                   reporter: int | None = None) -> None:
    """Record `rank`'s failure (written by `reporter`, default `rank`); the first record
    written is the one every rank sees. Gives up after a few seconds if the store hangs."""
    store = default_store()
    if store is None:
        return
    record = json.dumps({"rank": rank, "instruction": instruction, "message": message[:4000],
                         "reporter": rank if reporter is None else reporter})

    def write() -> None:
        if store.add(_COUNT_KEY, 1) == 1:
            store.set(_FIRST_KEY, record)

    bounded(write, _STORE_PATIENCE, None)  # the store gone or stuck: nothing left to tell


def read_failure(store: Any = None) -> FailureRecord | None:
    """The first failure recorded in this job, if any."""
    store = store if store is not None else default_store()
    if store is None:
        return None
    try:
        if not store.check([_FIRST_KEY]):
            return None
        raw = json.loads(store.get(_FIRST_KEY))
    except RuntimeError:
        return None
    return FailureRecord(int(raw["rank"]), raw["instruction"], str(raw["message"]),
                         int(raw.get("reporter", raw["rank"])))


class Watchdog:
    """Polls the store every `interval` seconds while the process group it started under
    lives; calls `on_peer_failure` once when a record written by another rank appears (by
    default: print it and end this process). With a `progress` record it answers probes."""

    def __init__(self, rank: int, *, progress: ProgressRecord | None = None,
                 on_peer_failure: Callable[[FailureRecord], None] | None = None,
                 interval: float = 0.1, delay: float = 0.0) -> None:
        self.rank = rank
        self.progress = progress
        self.interval = interval
        self.delay = delay
        """Seconds a peer's failure must have been seen before acting on it (an engine's
        watchdog leaves the launcher's one, which records why this rank stopped, to act)."""
        self._seen_at: float | None = None
        self.on_peer_failure = on_peer_failure or _exit_on_peer_failure(rank)
        self._answered = 0
        self._group: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pipesched-watchdog", daemon=True)

    def start(self) -> Watchdog:
        """Start polling (needs an initialised process group; without one, do nothing)."""
        if dist.is_initialized() and not self._thread.is_alive():
            self._group = dist.group.WORLD
            self._answered = bounded(lambda: probes_sent(default_store()), _STORE_PATIENCE, 0)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=_STORE_PATIENCE)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not dist.is_initialized() or dist.group.WORLD is not self._group:
                return  # the process group this watchdog served is gone
            store = default_store()
            try:
                record = read_failure(store)
                if record is not None and record.reporter != self.rank:
                    now = time.monotonic()
                    self._seen_at = self._seen_at if self._seen_at is not None else now
                    if now - self._seen_at >= self.delay:
                        self.on_peer_failure(record)
                        return
                if self.progress is not None:
                    self._answered = answer_probes(store, self.rank, self.progress.snapshot(),
                                                   self._answered)
            except RuntimeError:
                return  # the store is gone: the job is ending


def _exit_on_peer_failure(rank: int) -> Callable[[FailureRecord], None]:
    def stop(record: FailureRecord) -> None:
        print(f"[pipesched] rank {rank} stopping: {record.describe()}", file=sys.stderr,
              flush=True)
        os._exit(EXIT_PEER_FAILED)  # the main thread may be blocked in a receive forever
    return stop
