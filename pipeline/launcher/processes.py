"""`launch(fn, world_size)`: run `fn` on local ranks (or in place under torchrun), fail as one.

Spawned ranks rendezvous through a file in a fresh temporary directory, so nothing needs a
port. When a rank fails, its watchdog peers end within a poll interval; the launcher kills
any rank still alive after a short grace, then raises one `RankFailedError` naming the rank
that failed first and the instruction it failed at (or, after a timeout, the rank that
stopped progressing). When the launcher itself dies, at any moment from start-up on, every
rank ends and the launcher's temporary directories go (`pipeline.supervision.orphans`).
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
import torch.distributed as dist

from pipeline.device import (
    STAGED_PER_DEVICE,
    backend_reason,
    default_backend,
    process_group_timeout,
)
from pipeline.errors import PipelineConfigError
from pipeline.launcher.forkserver_guard import GUARD_ENV
from pipeline.launcher.results import (
    RankReport,
    Result,
    failure_error,
    read_result,
    write_result,
)
from pipeline.limits import MAX_TIMEOUT, check_local_ranks
from pipeline.staged_backend import backend_available
from pipeline.supervision.failure import EXIT_PEER_FAILED, FailureRecord, Watchdog, report_failure
from pipeline.supervision.orphans import (
    EXIT_LAUNCHER_GONE,
    ProcessIdentity,
    Reaper,
    die_with_parent,
    identity_of,
    is_running,
    remove_on_sigterm,
    watch_launcher,
)
from pipeline.supervision.progress import (
    StallError,
    default_store,
    explain_stall,
    looks_like_timeout,
)

__all__ = ["PreLaunchCheck", "launch"]

T = TypeVar("T")
_GRACE = 5.0  # seconds the other ranks get to stop by themselves once one has failed
_STARTED = "pipesched/ranks-started"  # store counter: ranks whose process group is up
_PRELOAD = ("pipeline.launcher.forkserver_guard",  # first: before torch's long import
            "torch", "torch.distributed", "torch._dynamo", "torch.optim",
            "pipeline.runtime.engine")


@runtime_checkable
class PreLaunchCheck(Protocol):
    """What `launch(..., check=)` runs before it starts any rank (`pipeline.runtime.
    launch_check.LaunchCheck` checks a module, engine options and a batch)."""

    def check(self, world_size: int) -> None:
        """Raise (a `PipelineConfigError`) if a run on `world_size` ranks would be refused."""


def launch(fn: Callable[..., T], world_size: int, *args: Any, timeout: float = 300.0,
           backend: str | None = None, join_timeout: float | None = None,
           threads_per_rank: int | None = 1, start_method: str | None = None,
           grace: float | None = None, quiet: bool = False,
           check: PreLaunchCheck | None = None) -> list[T]:
    """Run ``fn(*args)`` on `world_size` ranks with a process group set up; return the
    per-rank results (index = rank).

    Under torchrun (RANK and WORLD_SIZE set) `fn` runs in this process only, over env://,
    and the list holds this rank's result alone. `timeout` bounds every wait (a collective,
    or a receive of an engine given the same timeout); the rank that times out names the
    rank that stopped progressing. `join_timeout` (None: unbounded) bounds the whole run,
    start-up included, after which every rank is killed. Once a rank fails, the others get
    `grace` seconds (default min(5, timeout)) to stop by themselves and report, then are
    killed: a failed job ends within about that long. `quiet` ranks print nothing of their
    own or their peers' failures (the raised error carries them: for a command line that
    says one line). If this process dies, every rank ends
    at once and removes the run's temporary directories. `check` (a `LaunchCheck` of the
    module, options and batch `fn` uses) runs here first: a mistake every rank would refuse
    raises once, before any process starts.
    `fn` and `args` must be picklable (a module-level function) for spawned ranks; every
    rank must return a picklable value.
    """
    _check_arguments(fn, world_size, timeout, backend, join_timeout, threads_per_rank,
                     start_method)
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int | float)
                              or not (math.isfinite(grace) and grace >= 0)):
        raise PipelineConfigError(f"launch: grace must be None or a finite number of seconds "
                                  f">= 0, got {grace!r}")
    if check is not None:
        if not isinstance(check, PreLaunchCheck):
            raise PipelineConfigError(f"launch: check must be a pipeline.LaunchCheck (anything "
                                      f"with check(world_size)), got {check!r}")
        check.check(world_size)  # before any rank (under torchrun: before the process group)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return [_run_in_place(fn, world_size, args, timeout, backend, threads_per_rank)]
    check_local_ranks(world_size)
    try:  # fails at process start otherwise, with an error about pickling internals
        pickle.dumps((fn, args))
    except Exception as error:  # pickling raises many types; all mean the same here
        raise PipelineConfigError(
            f"fn={fn!r} and its args must be picklable to start spawned ranks ({error}); "
            "pass a module-level function and plain arguments, not a lambda or closure"
        ) from None
    return _spawn(fn, world_size, args, timeout, backend, join_timeout, threads_per_rank,
                  start_method, min(_GRACE, timeout) if grace is None else grace, quiet)


def _check_arguments(fn: object, world_size: object, timeout: object, backend: object,
                     join_timeout: object, threads: object, start_method: object) -> None:
    """Every problem with `launch`'s arguments at once, before any process starts."""
    def positive(value: object) -> bool:
        return isinstance(value, int | float) and not isinstance(value, bool) and \
            math.isfinite(value) and value > 0

    def count(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    problems = []
    if not callable(fn):
        problems.append(f"fn must be callable, got {fn!r}")
    if not count(world_size):
        problems.append(f"world_size must be an int >= 1, got {world_size!r}")
    if not positive(timeout) or timeout > MAX_TIMEOUT:  # type: ignore[operator]
        problems.append(f"timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got "
                        f"{timeout!r}")
    if join_timeout is not None and (not positive(join_timeout) or
                                     join_timeout > MAX_TIMEOUT):  # type: ignore[operator]
        problems.append(f"join_timeout must be None or a number of seconds in (0, "
                        f"{MAX_TIMEOUT:g}], got {join_timeout!r}")
    if threads is not None and not count(threads):
        problems.append(f"threads_per_rank must be None or an int >= 1, got {threads!r}")
    methods = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        problems.append(f"start_method must be None or one of {methods}, got {start_method!r}")
    if backend is not None and not (isinstance(backend, str) and backend_available(backend)):
        available = [name for name in ("gloo", "nccl", "mpi", "ucc")
                     if dist.is_backend_available(name)]
        problems.append(f"backend must be None, an available backend {available} or one per "
                        f"device such as {STAGED_PER_DEVICE!r}, got {backend!r}")
    if problems:
        raise PipelineConfigError("launch: " + "; ".join(problems))


def _run_in_place(fn: Callable[..., T], world_size: int, args: tuple[Any, ...], timeout: float,
                  backend: str | None, threads: int | None) -> T:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise PipelineConfigError(f"launch(world_size={world_size}) runs under torchrun with "
                                  f"WORLD_SIZE={env_world}; make them agree")
    torchrun_directories = _torchrun_directories()
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is our parent: end with it
        watch_launcher(identity_of(os.getppid()), torchrun_directories)
    if threads:
        torch.set_num_threads(threads)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(_prepared(backend or default_backend(), int(os.environ.get(
            "LOCAL_WORLD_SIZE", world_size)), int(os.environ["RANK"])), init_method="env://",
                                timeout=process_group_timeout(timeout))
    rank = dist.get_rank()
    watchdog = Watchdog(rank).start()
    try:
        with remove_on_sigterm(torchrun_directories):  # the agent stopping us leaves nothing
            return fn(*args)
    except BaseException as error:
        report = _report(rank, dist.get_world_size(), error)
        if report.kind in ("error", "exit"):
            report_failure(rank, report.instruction, report.message)
        raise
    finally:
        watchdog.stop()
        if created:
            dist.destroy_process_group()


def _prepared(backend: str, ranks_on_host: int, rank: int) -> str:
    """`backend`, registered where it is ours; rank 0 names a staged transport (ranks sharing
    a GPU) on stderr, so a slower run says why."""
    backend_available(backend)
    if rank == 0 and backend == STAGED_PER_DEVICE:
        print(backend_reason(backend, ranks_on_host), file=sys.stderr, flush=True)
    return backend


def _torchrun_directories() -> list[str]:
    """The temporary log directory torchrun's agent made for this run (it cannot remove it
    once killed): ``<tmp>/torchelastic_*/<run id>/attempt_<n>/<rank>/error.json``."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(error_file))))
    inside_tmp = os.path.dirname(root) == os.path.realpath(tempfile.gettempdir()) or \
        os.path.dirname(root) == tempfile.gettempdir()
    return [root] if error_file and inside_tmp and \
        os.path.basename(root).startswith("torchelastic_") else []


def _context(start_method: str | None) -> Any:
    method = start_method or ("forkserver" if sys.platform.startswith("linux") else "spawn")
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(_PRELOAD))  # ranks fork with torch already imported
        _start_fork_server_deaf_to_ctrl_c()
    return context


def _start_fork_server_deaf_to_ctrl_c() -> None:
    """Start the fork server (and resource tracker) deaf to SIGINT: a Ctrl-C on the terminal
    reaches the whole process group, and the fork server, still importing torch, printed a
    KeyboardInterrupt traceback; its ranks inherit the same, so the launcher alone answers
    Ctrl-C (one line) and ends them."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    # SIGINT blocked, not ignored: an ignored signal is discarded, so a Ctrl-C in this window
    # was lost; a blocked one stays pending and raises KeyboardInterrupt here once unblocked.
    # The fork server inherits the blocked mask (deaf while it starts) and its first preload,
    # `forkserver_guard`, ignores SIGINT for good and unblocks it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.environ[GUARD_ENV] = str(os.getpid())  # the fork server dies with this process
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(GUARD_ENV, None)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _owned_directories(context: Any) -> list[str]:
    """This process's temporary directories a rank removes if the launcher dies: the fork
    server's socket lives in multiprocessing's per-process directory."""
    if context.get_start_method() != "forkserver":
        return []
    return [multiprocessing.util.get_temp_dir()]  # created now, so the fork server uses it


def _spawn(fn: Callable[..., T], world_size: int, args: tuple[Any, ...], timeout: float,
           backend: str | None, join_timeout: float | None, threads: int | None,
           start_method: str | None, grace: float, quiet: bool) -> list[T]:
    context = _context(start_method)
    workdir = tempfile.mkdtemp(prefix="pipesched-")
    launcher = identity_of(os.getpid())
    cleanup = [workdir, *_owned_directories(context)]
    reaper = Reaper(cleanup)  # before any rank: from now on nothing outlives this process
    # A path, not a file:// URL: a '#', '?' or newline in TMPDIR would end or bend the URL
    # (the rendezvous escaped to a shorter path, went stale, and later launches hung)
    rendezvous = os.path.join(workdir, "rendezvous")
    processes = [context.Process(target=_worker, name=f"pipesched-rank-{rank}", args=(
        rank, world_size, rendezvous, backend or default_backend(world_size), timeout,
        threads, fn,
        args, workdir, launcher, cleanup, quiet)) for rank in range(world_size)]
    try:
        with _signals_deferred():  # a rank started but not yet known could not be stopped
            for process in processes:
                process.start()
                reaper.watch(process.pid)
        still_running, first_failed = _supervise(
            processes, grace, join_timeout,
            silent=lambda rank: not os.path.exists(os.path.join(workdir, f"rank{rank}.result")))
        for process in processes:
            process.join(timeout=5)  # killed ranks: read their real exit codes
        results = [read_result(workdir, rank) for rank in range(world_size)]
        codes = tuple(process.exitcode for process in processes)
        if _interrupted(results):
            raise KeyboardInterrupt("the ranks were interrupted")
        error = failure_error(results, codes, first_failed, still_running, join_timeout)
        if error is not None:
            raise error
        return [result[1] for result in results  # type: ignore[misc]  # every rank's "ok"
                if result is not None]
    finally:
        for process in processes:
            if process.pid is None:
                continue  # never started (a start failed): nothing to stop
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)
        reaper.close()


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM (on the main thread; elsewhere they cannot be caught) while
    ranks start, then deliver them: `Process.start` interrupted after the fork but before it
    learnt the pid would leave a running rank the launcher cannot name."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(number: int, frame: FrameType | None) -> None:
        received.append(number)

    previous = {number: signal.signal(number, hold) for number in (signal.SIGINT,
                                                                    signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for held in dict.fromkeys(received):
            signal.raise_signal(held)


def _supervise(processes: list[Any], grace: float, join_timeout: float | None,
               silent: Callable[[int], bool]) -> tuple[list[int] | None, list[int]]:
    """Wait for every rank; once one fails, kill the rest after `grace` seconds, and every
    rank on the deadline. Returns the ranks still running at the deadline (None when it did
    not pass) and the ranks seen failing first (in the same wake-up). A rank that ended with
    code 0 but `silent` (no result: ``os._exit(0)`` mid-step) failed too: the errors its
    peers then raise ("Connection closed by peer") are its echo."""
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    failed_at: float | None = None
    first_failed: list[int] = []
    alive = list(processes)
    while alive:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            for process in alive:
                process.kill()
            return [processes.index(p) for p in alive], first_failed
        if failed_at is not None and now - failed_at >= grace:
            for process in alive:
                process.kill()
            return None, first_failed
        limits = [0.5] + ([deadline - now] if deadline is not None else []) + \
            ([failed_at + grace - now] if failed_at is not None else [])
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=max(0.0, min(limits)))
        ended = [p for p in alive if not p.is_alive()]
        for process in ended:
            alive.remove(process)
        failing = [processes.index(p) for p in ended
                   if p.exitcode != 0 or silent(processes.index(p))]
        if failed_at is None and failing:
            failed_at = time.monotonic()
            first_failed = failing
    return None, first_failed


def _worker(rank: int, world_size: int, rendezvous: str, backend: str, timeout: float,
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
        dist.init_process_group(_prepared(backend, world_size, rank), store=store, rank=rank,
                                world_size=world_size,
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
        payload = ("error", _report(rank, world_size, error))
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


def _interrupted(results: list[Result | None]) -> bool:
    """Whether a rank was interrupted (Ctrl-C) and none failed by itself."""
    kinds = {result[1].kind for result in results if result is not None and
             result[0] == "error"}
    return "interrupted" in kinds and not kinds & {"error", "exit"}


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


def _report(rank: int, world_size: int, error: BaseException) -> RankReport:
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
