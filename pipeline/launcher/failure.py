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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

__all__ = ["EXIT_PEER_FAILED", "PROGRESS", "FailureRecord", "Progress", "Watchdog",
           "explain_stall", "read_failure", "report_failure", "start_watchdog", "stop_watchdog"]

EXIT_PEER_FAILED = 3
"""Exit code of a rank stopped because another rank failed."""
_FIRST_KEY = "pipesched/failure/first"
_COUNT_KEY = "pipesched/failure/count"
_PROBE_KEY = "pipesched/probe"


class Progress:
    """What this rank's main thread is doing: the watchdog reads it to answer stall probes."""

    def __init__(self) -> None:
        self.instruction: object = None
        """The instruction being executed (formatted only when a probe asks)."""
        self.waiting_on: int | None = None
        """Global rank whose data the main thread is blocked on, if any."""


PROGRESS = Progress()


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
        self._answered = ""
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
            self._answer_probe()

    def _answer_probe(self) -> None:
        """Tell a rank that timed out what this rank is doing (see `explain_stall`)."""
        store = _store()
        try:
            if store is None or not store.check([_PROBE_KEY]):
                return
            probe = store.get(_PROBE_KEY).decode()
            if probe != self._answered:
                self._answered = probe
                instruction = PROGRESS.instruction
                store.set(f"{_PROBE_KEY}/{probe}/{self.rank}", json.dumps(
                    [None if instruction is None else str(instruction), PROGRESS.waiting_on]))
        except RuntimeError:
            pass


def explain_stall(waited_for: int, ranks: list[int], patience: float = 1.0) -> str:
    """Ask every rank (through their watchdogs) what it is doing and follow the chain of
    waits from `waited_for` to the rank that holds everyone up; '' when nobody answers."""
    store = _store()
    if store is None or _watchdog is None:
        return ""
    try:
        probe = str(store.add(f"{_PROBE_KEY}/count", 1))
        store.set(_PROBE_KEY, probe)
        answers: dict[int, tuple[str | None, int | None]] = {}
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline and len(answers) < len(ranks) - 1:
            for rank in ranks:
                key = f"{_PROBE_KEY}/{probe}/{rank}"
                if rank not in answers and rank != _watchdog.rank and store.check([key]):
                    instruction, waiting_on = json.loads(store.get(key))
                    answers[rank] = (instruction, waiting_on)
            time.sleep(0.02)
    except RuntimeError:
        return ""
    rank, seen = waited_for, []
    while rank in answers and rank not in seen:
        seen.append(rank)
        instruction, waiting_on = answers[rank]
        if waiting_on is None:
            return (f"rank {rank} holds the pipeline up: it is in {instruction or 'no step'} "
                    f"and not waiting for data (chain of waits: {' -> '.join(map(str, seen))})")
        rank = waiting_on
    if rank not in answers:
        return f"rank {rank} did not answer (chain of waits: {' -> '.join(map(str, seen))})"
    return f"the ranks wait for each other in a cycle: {' -> '.join(map(str, [*seen, rank]))}"


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
