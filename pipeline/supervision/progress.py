"""What each rank is doing (its progress record), and naming the rank that holds a stall up.

The engine owns one `ProgressRecord`; its main thread marks every phase and instruction in
it, and its watchdog answers stall probes with a snapshot. A rank that times out probes every
rank and follows the waits:

    rank 0 --waits on--> rank 1 --waits on--> rank 2   (2 answers "busy in 2F3": culprit)
    rank 0 --waits on--> rank 1 (no answer: SIGSTOPped, hung or dead: culprit)
    every rank in a collective but rank 3, which answers "between steps": culprit

`name_culprit` is that rule as a pure function; `explain_stall` asks the ranks through the
process group's store.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import torch.distributed as dist

__all__ = ["EVERY_RANK", "ProgressRecord", "RankState", "Stall", "StallError", "answer_probes",
           "bounded", "default_store", "explain_stall", "explain_timeout", "looks_like_timeout",
           "name_culprit", "probes_sent"]

EVERY_RANK = -1
"""`waiting_on` of a rank blocked in a collective: it waits on every rank of its group."""
_PROBE_COUNT = "pipesched/probe/count"
_T = TypeVar("_T")


class RankState(NamedTuple):
    """One rank's answer to a probe."""

    phase: str
    instruction: str | None
    waiting_on: int | None
    """Global rank whose data the rank is blocked on, `EVERY_RANK` in a collective, or None."""
    marks: int
    """How many phases and instructions the rank has entered (advances while it progresses)."""

    def where(self) -> str:
        return f"{self.instruction} ({self.phase})" if self.instruction else self.phase


class ProgressRecord:
    """What this rank's main thread is doing; written by it, read by its watchdog thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.phase = "starting"
        self.instruction: object = None
        """The instruction being executed (formatted only when a probe asks)."""
        self.waiting_on: int | None = None
        self.marks = 0

    def enter(self, phase: str, *, collective: bool = False) -> None:
        """The main thread starts `phase` (in a collective over every rank, if `collective`)."""
        self.phase, self.instruction = phase, None
        self.waiting_on = EVERY_RANK if collective else None
        self.marks += 1

    def execute(self, instruction: object) -> None:
        """The main thread starts `instruction` (busy until it blocks in a receive)."""
        self.instruction, self.waiting_on = instruction, None
        self.marks += 1

    def wait_on(self, rank: int | None) -> None:
        """The main thread blocks on data from global `rank` (None: no longer blocked)."""
        self.waiting_on = rank

    def snapshot(self) -> RankState:
        instruction = self.instruction
        return RankState(self.phase, None if instruction is None else str(instruction),
                         self.waiting_on, self.marks)


class Stall(NamedTuple):
    """Who holds a stalled job up (None when nobody can be named) and how we know."""

    culprit: int | None
    explanation: str


class StallError(RuntimeError):
    """A wait timed out; `culprit` is the rank that stopped progressing, when it is known."""

    def __init__(self, message: str, *, culprit: int | None) -> None:
        self.culprit = culprit
        super().__init__(message)


def looks_like_timeout(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is a wait that ran out of time (gloo's and the
    store's errors are plain RuntimeErrors: only their text says so)."""
    seen: BaseException | None = error
    for _ in range(8):  # the chain of causes is short; bound it all the same
        if seen is None:
            return False
        if isinstance(seen, TimeoutError) or "timed out" in str(seen).lower() or \
                "timeout" in type(seen).__name__.lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def name_culprit(answers: Mapping[int, RankState], ranks: Sequence[int], me: int,
                 waited_for: int | None, patience: float) -> Stall:
    """The rank that stopped progressing: follow the waits from `waited_for` (the rank `me`
    timed out on; None after a collective) to a rank that does not answer or is busy (unless
    another rank answers nothing: a busy rank may be blocked in a collective inside its
    instruction with that one); in a collective, the first silent rank, else the first busy
    one."""
    def silent(rank: int) -> str:
        return (f"rank {rank} stopped progressing: it answered no probe within {patience:g} s "
                f"(stopped, hung outside Python, dead, or not yet running an engine)")

    chain = [me]
    rank = waited_for
    while rank is not None and rank != EVERY_RANK and rank not in chain:
        chain.append(rank)
        waits = " -> ".join(map(str, chain))
        if rank not in answers:
            return Stall(rank, f"{silent(rank)}; chain of waits: {waits}")
        state = answers[rank]
        if state.waiting_on is None:
            quiet = [r for r in ranks if r != me and r not in answers]
            if quiet:  # `rank` is blocked with it inside the instruction (a tp all-reduce,
                # an expert all-to-all): the rank that answers nothing stopped, not `rank`
                return Stall(quiet[0], f"{silent(quiet[0])}; rank {rank}, at the end of the "
                                       f"chain of waits {waits}, answers from inside "
                                       f"{state.where()} (a collective with it)")
            return Stall(rank, f"rank {rank} holds the pipeline up: it is in {state.where()} "
                               f"and not waiting for data; chain of waits: {waits}")
        rank = state.waiting_on
    if rank is not None and rank != EVERY_RANK:
        return Stall(None, "the ranks wait for each other in a cycle: "
                           + " -> ".join(map(str, [*chain, rank])))
    others = [r for r in ranks if r != me]
    for r in others:
        if r not in answers:
            return Stall(r, silent(r))
    waiting_in = {answers[r].phase for r in others if answers[r].waiting_on is not None}
    for r in others:
        if answers[r].waiting_on is None:
            reached = " or ".join(sorted(waiting_in)) or "the collective the others wait in"
            return Stall(r, f"rank {r} has not reached {reached}: it is in "
                            f"{answers[r].where()}")
    return Stall(None, "every rank answered and waits: " + "; ".join(
        f"rank {r} in {answers[r].where()}" for r in others))


def default_store() -> Any:
    """The default process group's store (None without a process group)."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def bounded(action: Callable[[], _T], seconds: float, default: _T) -> _T:
    """`action()`, or `default` when it takes longer than `seconds` or raises RuntimeError.

    A rank stopped while it holds the file store's lock blocks every store call of every
    rank forever (flock has no timeout), so failure paths never call the store unbounded.
    """
    result: list[_T] = []

    def run() -> None:
        try:
            result.append(action())
        except RuntimeError:
            pass

    thread = threading.Thread(target=run, name="pipesched-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else default


def probes_sent(store: Any) -> int:
    """How many probes were sent so far (read only: on a file store `add(key, 0)` would
    append to the file at every poll)."""
    return int(store.get(_PROBE_COUNT)) if store.check([_PROBE_COUNT]) else 0


def answer_probes(store: Any, rank: int, state: RankState, answered: int) -> int:
    """Answer every probe sent since probe `answered` (at most the last 8); returns the last
    probe answered. Called by a watchdog thread."""
    latest = probes_sent(store)
    for probe in range(max(answered + 1, latest - 7), latest + 1):
        store.set(f"pipesched/probe/{probe}/{rank}", json.dumps(state))
    return latest


def explain_stall(me: int, ranks: Sequence[int], waited_for: int | None,
                  patience: float = 2.0) -> Stall:
    """Probe every rank of `ranks` (their watchdogs answer with their progress records) for
    up to `patience` seconds and name the rank that holds the job up."""
    store = default_store()
    if store is None:
        return Stall(None, "")
    answers: dict[int, RankState] = {}

    def ask() -> bool:
        probe = int(store.add(_PROBE_COUNT, 1))
        deadline = time.monotonic() + patience
        others = [r for r in ranks if r != me]
        while time.monotonic() < deadline and len(answers) < len(others):
            for rank in others:
                key = f"pipesched/probe/{probe}/{rank}"
                if rank not in answers and store.check([key]):
                    answers[rank] = RankState(*json.loads(store.get(key)))
            time.sleep(0.05)
        return True

    if not bounded(ask, patience + 3.0, False):
        return Stall(None, "the rendezvous store did not answer (a rank may be stopped "
                           "while holding its lock)")
    return name_culprit(answers, ranks, me, waited_for, patience)


def explain_timeout(error: Exception, me: int, ranks: Sequence[int]) -> Exception:
    """`error`, or a `StallError` naming the rank that stopped when `error` is a collective's
    timeout (probe before recording any failure: a record ends the ranks that would answer)."""
    if isinstance(error, StallError) or not looks_like_timeout(error):
        return error
    stall = explain_stall(me, ranks, None)
    if stall.culprit is None or stall.culprit == me:
        return error
    explained = StallError(f"{error}; {stall.explanation}", culprit=stall.culprit)
    explained.__cause__ = error
    return explained
