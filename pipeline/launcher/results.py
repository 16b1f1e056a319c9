"""What each launched rank leaves behind (its result, or why it has none), and the one error
`launch` raises from all of them.

A rank writes ``rank<r>.result`` in the launcher's directory: ``("ok", value)`` or
``("error", RankReport)``. A report's `kind` says whose fault it is: ``"error"`` the rank's
own exception, ``"exit"`` it called sys.exit, ``"stall"`` it timed out and names the rank
that stopped progressing, ``"stopped"`` another rank's failure stopped it, ``"interrupted"``
a SIGINT (Ctrl-C) ended it.
"""

from __future__ import annotations

import os
import pickle
import signal
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.errors import RankFailedError

__all__ = ["RankReport", "Result", "failure_error", "read_result", "write_result"]

Kind = Literal["error", "exit", "stall", "stopped", "interrupted"]


@dataclass(frozen=True)
class RankReport:
    """Why a rank returned no value."""

    kind: Kind
    message: str
    time: float
    """When the rank gave up (time.time(); ranks of one host share the clock)."""
    instruction: str | None = None
    caused_by: int | None = None
    """The rank this one blames ("stall", "stopped"); None for its own failure."""
    traceback: str = ""


Result = tuple[Literal["ok"], Any] | tuple[Literal["error"], RankReport]


def write_result(workdir: str, rank: int, payload: Result) -> None:
    """Atomically leave `payload` for the launcher (the value must be picklable: check it
    with `pickle.dumps` first, as `launch`'s worker does)."""
    path = os.path.join(workdir, f"rank{rank}.result")
    with open(path + ".tmp", "wb") as handle:
        handle.write(pickle.dumps(payload))
    os.replace(path + ".tmp", path)


def read_result(workdir: str, rank: int) -> Result | None:
    try:
        with open(os.path.join(workdir, f"rank{rank}.result"), "rb") as handle:
            payload: Result = pickle.load(handle)
            return payload
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return None


def _summary(codes: tuple[int | None, ...]) -> str:
    return ", ".join(f"rank {r}: exit {code}" for r, code in enumerate(codes))


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return "an unknown signal"


def _reports(results: list[Result | None], kinds: tuple[Kind, ...]
             ) -> list[tuple[int, RankReport]]:
    found = [(rank, result[1]) for rank, result in enumerate(results)
             if result is not None and result[0] == "error" and result[1].kind in kinds]
    return sorted(found, key=lambda item: (item[1].time, item[0]))


def failure_error(results: list[Result | None], codes: tuple[int | None, ...],
                  first_failed: list[int], still_running: list[int] | None,
                  join_timeout: float | None) -> RankFailedError | None:
    """One error naming the rank that failed first, or None when every rank returned.

    In order: the join deadline passing (`still_running` the ranks it found running); a
    rank killed by a signal, or exiting non-zero without a report, before any other failed
    (the others' errors are its echo); a rank's own exception or sys.exit; the rank that
    timed-out ranks name as stalled; the rank a stopped rank read in the failure record; a
    rank that died without a word; a rank that ended with code 0 but no result. An error
    every rank raised alike (a refusal each reaches on its own) is reported once, as every
    rank's, with the lowest rank's details (`rank`), rather than as whichever rank wrote
    first."""
    summary = _summary(codes)
    if still_running is not None:
        finished = [r for r in range(len(codes)) if r not in still_running]
        return RankFailedError(
            f"rank {still_running[0]} was still running when join_timeout={join_timeout}s "
            f"passed (running: {still_running}, finished: {finished}); every running rank "
            f"was killed ({summary})", rank=still_running[0], exit_codes=codes)
    for rank in first_failed:
        code = codes[rank]
        if results[rank] is None and code is not None and code < 0:
            return RankFailedError(
                f"rank {rank} was killed by signal {-code} ({_signal_name(code)}) without "
                f"reporting an error; every other rank was stopped ({summary})",
                rank=rank, exit_codes=codes)
        if results[rank] is None and code is not None and code > 0:
            # os._exit(n) or a crash inside a collective: its partners' errors ("Connection
            # reset by peer") are its echo, not their own faults
            return RankFailedError(
                f"rank {rank} exited with code {code} without reporting an error (os._exit, "
                f"or a crash outside Python); the other ranks' errors followed from it "
                f"({summary})", rank=rank, exit_codes=codes)
    for rank in first_failed:
        if results[rank] is None and codes[rank] == 0:
            return RankFailedError(
                f"rank {rank} exited with code 0 without returning a result (did fn call "
                f"os._exit?) while the others still ran: their errors followed from it "
                f"({summary})", rank=rank, exit_codes=codes)
    own = _reports(results, ("error", "exit"))
    if own:
        rank, report = own[0]
        who = f"rank {rank} failed"
        if len(own) == len(results) > 1 and len({r.message for _, r in own}) == 1:
            # a refusal every rank raised: no rank is to blame; the lowest rank's details
            rank, report = min(own, key=lambda item: item[0])
            who = f"every rank ({len(results)}) failed with the same error"
        where = f" at instruction {report.instruction}" if report.instruction else ""
        tail = f"\n--- traceback of rank {rank} ---\n{report.traceback}" if report.traceback \
            else ""
        return RankFailedError(f"{who}{where}: {report.message}\n({summary}){tail}",
                               rank=rank, instruction=report.instruction, exit_codes=codes)
    stalls = [(rank, report, report.caused_by) for rank, report in _reports(results, ("stall",))
              if report.caused_by is not None]
    if stalls:  # the rank most reporters name; among equals, the one named first
        votes = Counter(named for _, _, named in stalls)
        culprit = max(votes, key=lambda rank: (votes[rank], -min(
            report.time for _, report, named in stalls if named == rank)))
        reporter, report, _ = next(item for item in stalls if item[2] == culprit)
        return RankFailedError(
            f"rank {culprit} stopped progressing; rank {reporter} timed out waiting: "
            f"{report.message}\n({summary})", rank=culprit, exit_codes=codes)
    stopped = _reports(results, ("stopped",))
    if stopped:  # the culprit's own report was lost (killed late): the record says who
        reporter, report = stopped[0]
        blamed = report.caused_by if report.caused_by is not None else reporter
        return RankFailedError(f"rank {blamed} failed; rank {reporter} {report.message} "
                               f"({summary})", rank=blamed, exit_codes=codes)
    for rank, result in enumerate(results):
        code = codes[rank]
        if result is None and code:
            why = (f"was killed by signal {-code} ({_signal_name(code)}) after another rank "
                   f"failed" if code < 0 else f"exited with code {code} without reporting "
                   f"an error")
            return RankFailedError(f"rank {rank} {why} ({summary})", rank=rank,
                                   exit_codes=codes)
    for rank, result in enumerate(results):
        if result is None:
            return RankFailedError(
                f"rank {rank} exited with code 0 without returning a result (did fn call "
                f"os._exit?); launch needs fn to return on every rank ({summary})",
                rank=rank, exit_codes=codes)
    return None
