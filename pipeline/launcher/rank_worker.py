"""One spawned rank: join the process group, run `fn`, leave a result, report a failure."""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipeline.device import STAGED_PER_DEVICE, backend_reason, process_group_timeout
from pipeline.device.staged_backend import backend_available
from pipeline.errors import PipelineConfigError
from pipeline.launcher.results import RankReport, Result, write_result
from pipeline.supervision.failure import EXIT_PEER_FAILED, FailureRecord, Watchdog, report_failure
from pipeline.supervision.orphans import (
    EXIT_LAUNCHER_GONE,
    ProcessIdentity,
    die_with_parent,
    is_running,
    watch_launcher,
)
from pipeline.supervision.progress import (
    StallError,
    default_store,
    explain_stall,
    looks_like_timeout,
)

__all__ = ["prepared_backend", "rank_report", "worker"]

_STARTED = "pipesched/ranks-started"  # store counter: ranks whose process group is up


def prepared_backend(backend: str, ranks_on_host: int, rank: int) -> str:
    """`backend`, registered where it is ours; rank 0 names a staged transport (ranks sharing
    a GPU) on stderr, so a slower run says why."""
    backend_available(backend)
    if rank == 0 and backend == STAGED_PER_DEVICE:
        print(backend_reason(backend, ranks_on_host), file=sys.stderr, flush=True)
    return backend



def worker(rank: int, world_size: int, rendezvous: str, backend: str, timeout: float,
           threads: int | None, fn: Callable[..., Any], args: tuple[Any, ...],
           workdir: str, launcher: ProcessIdentity, cleanup: list[str], quiet: bool) -> None:
    die_with_parent(launcher)  # even while blocked in C holding the GIL
    watch_launcher(launcher, cleanup)
    if threads:
        torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    payload: Result
    watchdog: Watchdog | None = None
    try:
        _check_rendezvous(rendezvous, launcher)
        store = dist.FileStore(rendezvous, world_size)
        dist.init_process_group(prepared_backend(backend, world_size, rank), store=store,
                                rank=rank, world_size=world_size,
                                timeout=process_group_timeout(timeout))
        watchdog = Watchdog(rank, on_peer_failure=lambda record: _stopped(workdir, rank, record,
                                                                   quiet))
        watchdog.start()
        _all_started(world_size, timeout)
        value = fn(*args)
        try:
            pickle.dumps(value)
        except Exception as error:  # pickling raises many types; all mean the same here
            raise PipelineConfigError(
                f"rank {rank}'s result, a {type(value).__name__}, cannot be pickled to send "
                f"it to the launcher ({type(error).__name__}: {error}); return plain data "
                "(tensors, numbers, lists, dicts, dataclasses)") from None
        payload = ("ok", value)
    except BaseException as error:  # report everything, including KeyboardInterrupt
        payload = ("error", rank_report(rank, world_size, error))
    write_result(workdir, rank, payload)  # first: the launcher may kill this rank soon
    # Ctrl-C reaches every rank of the terminal's process group: each ends quietly, and the
    # launcher, interrupted too, says so once.
    interrupted = payload[0] == "error" and payload[1].kind == "interrupted"
    if payload[0] == "error" and payload[1].kind in ("error", "exit"):
        report_failure(rank, payload[1].instruction, payload[1].message)  # stops the others
    if payload[0] == "error" and not interrupted and not quiet \
            and not _is_config_mistake(payload[1].message):
        print(f"[pipesched] rank {rank}: {payload[1].traceback or payload[1].message}",
              file=sys.stderr, flush=True)
    if watchdog is not None:
        watchdog.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    if payload[0] != "ok":
        sys.exit(1)



def _check_rendezvous(rendezvous: str, launcher: ProcessIdentity) -> None:
    """End now if the launcher is gone or removed the rendezvous directory: torch's
    `FileStore` would otherwise retry the missing file for 300 s holding the GIL."""
    if not os.path.isdir(os.path.dirname(rendezvous)) or \
            not is_running(launcher):
        os._exit(EXIT_LAUNCHER_GONE)


def _all_started(world_size: int, timeout: float) -> None:
    """Wait until every rank's process group is up before running `fn`: a rank whose `fn`
    returned at once could exit and close the gloo connections a slower rank was still
    making (seen in CI: that rank failed in `init_process_group` with "Connection closed by
    peer", hiding why the job really ended). A counter in the rendezvous store, not a
    collective, so it needs no device and a rank that failed to start is reported by the
    watchdog, not waited for."""
    store = default_store()
    if store is None:
        return
    store.add(_STARTED, 1)
    deadline = time.monotonic() + timeout
    while int(store.add(_STARTED, 0)) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank started within timeout={timeout:g}s")
        time.sleep(0.005)


def rank_report(rank: int, world_size: int, error: BaseException) -> RankReport:
    """Why `fn` failed on this rank. After a timeout, probe the ranks and report the one that
    stopped progressing (and record it, so that every rank stops)."""
    now, trace = time.time(), traceback.format_exc()
    instruction = getattr(error, "instruction", None)
    message = f"{type(error).__name__}: {error}"
    if isinstance(error, KeyboardInterrupt):
        return RankReport("interrupted", f"rank {rank} was interrupted (SIGINT)", now)
    if isinstance(error, SystemExit):
        return RankReport("exit", f"fn called sys.exit({error.code!r}) on rank {rank} instead "
                          "of returning a value", now, traceback=trace)
    caused_by = getattr(error, "caused_by", None)
    if caused_by is not None:
        if isinstance(error.__cause__, StallError):
            return RankReport("stall", message, now, instruction, caused_by, trace)
        return RankReport("stopped", message, now, instruction, caused_by, trace)
    if looks_like_timeout(error) and dist.is_initialized():
        stall = explain_stall(rank, list(range(world_size)), None)
        if stall.culprit is not None:
            report_failure(stall.culprit, None, f"stopped progressing ({stall.explanation})",
                           reporter=rank)
            return RankReport("stall", f"{message}; {stall.explanation}", now, instruction,
                              stall.culprit, trace)
    return RankReport("error", message, now, instruction, None, trace)


def _stopped(workdir: str, rank: int, record: FailureRecord, quiet: bool) -> None:
    """This rank's watchdog saw another rank's failure: leave a report and end at once."""
    write_result(workdir, rank, ("error", RankReport(
        "stopped", f"stopped because {record.describe()}", time.time(),
        caused_by=record.rank)))
    if not quiet and not _is_config_mistake(record.message):
        print(f"[pipesched] rank {rank} stopping: {record.describe()}", file=sys.stderr,
              flush=True)
    os._exit(EXIT_PEER_FAILED)  # the main thread may be blocked in a receive forever


def _is_config_mistake(message: str) -> bool:
    """A `PipelineConfigError` (the same mistake on every rank, e.g. a typo'd schedule): the
    error `launch` raises says it once, so no rank prints it (once per rank, 4-8 times)."""
    return message.startswith(f"{PipelineConfigError.__name__}: ")
