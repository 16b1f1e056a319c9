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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch.distributed as dist

from pipeline.device import (
    STAGED_PER_DEVICE,
    default_backend,
)
from pipeline.device.staged_backend import backend_available
from pipeline.errors import PipelineConfigError
from pipeline.launcher.forkserver_guard import GUARD_ENV
from pipeline.launcher.forkserver_ready import READY_ENV
from pipeline.launcher.in_place import run_in_place
from pipeline.launcher.rank_worker import worker
from pipeline.launcher.results import (
    Result,
    failure_error,
    read_result,
)
from pipeline.limits import MAX_TIMEOUT, check_local_ranks
from pipeline.supervision.orphans import (
    ProcessIdentity,
    Reaper,
    identity_of,
    is_running,
)

__all__ = ["PreLaunchCheck", "launch"]

T = TypeVar("T")
_GRACE = 5.0  # seconds the other ranks get to stop by themselves once one has failed
_PRELOAD = ("pipeline.launcher.forkserver_guard",  # first: before torch's long import
            "torch", "torch.distributed", "torch._dynamo", "torch.optim",
            "pipeline.runtime.engine",
            "pipeline.launcher.forkserver_ready")  # last: says the imports are done
_READY_PATIENCE = 300.0  # seconds the launcher waits, signals free, for the fork server
# One thread at a time starts the fork server: GUARD_ENV lives in the process-wide
# environment, and a worker thread starting the server while the main thread had it set
# gave the server a parent-death signal tied to that worker thread, so the server died when
# the thread ended (a job launched from a thread pool, then the next launch hit EOF).
_START_LOCK = threading.Lock()


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
        return [run_in_place(fn, world_size, args, timeout, backend, threads_per_rank)]
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


def _method(start_method: str | None) -> str:
    return start_method or ("forkserver" if sys.platform.startswith("linux") else "spawn")


def _context(start_method: str | None) -> Any:
    method = _method(start_method)
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(_PRELOAD))  # ranks fork with torch already imported
        _start_fork_server_deaf_to_ctrl_c()
    return context


def _start_fork_server_deaf_to_ctrl_c() -> None:
    """Start the fork server (and resource tracker) deaf to SIGINT: a Ctrl-C on the terminal
    reaches the whole process group, and the fork server, still importing torch, printed a
    KeyboardInterrupt traceback; its ranks inherit the same, so the launcher alone answers
    Ctrl-C (one line) and ends them. Then, if it started one, wait with SIGINT and SIGTERM
    free until the fork server has imported its preloads: the first rank's start waits for
    that import (15 s on a loaded host), and ranks start with those signals held."""
    ready = os.path.join(multiprocessing.util.get_temp_dir(), "pipesched-forkserver-ready")
    with _START_LOCK:
        server = _start_fork_server_locked(ready)
    if server is None:
        return
    try:
        deadline = time.monotonic() + _READY_PATIENCE
        # no /proc (started None): no wait, the ranks' start waits instead
        while server.started is not None and is_running(server) and \
                not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        if os.path.exists(ready):
            os.remove(ready)


def _start_fork_server_locked(ready: str) -> ProcessIdentity | None:
    """Start the fork server if none runs; the one started here, on the main thread, to
    create `ready` once it has imported its preloads (None otherwise)."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return None
    state: Any = forkserver._forkserver  # private: no public way to the fork server's pid
    before = state._forkserver_pid
    # SIGINT blocked, not ignored: an ignored signal is discarded, so a Ctrl-C in this window
    # was lost; a blocked one stays pending and raises KeyboardInterrupt here once unblocked.
    # The fork server inherits the blocked mask (deaf while it starts) and its first preload,
    # `forkserver_guard`, ignores SIGINT for good and unblocks it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    os.environ[GUARD_ENV] = str(os.getpid())  # the fork server dies with this process
    os.environ[READY_ENV] = ready  # and says when it is ready (`forkserver_ready`)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(GUARD_ENV, None)
        os.environ.pop(READY_ENV, None)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    server: int | None = state._forkserver_pid
    return None if server is None or server == before else identity_of(server)


def _owned_directories(method: str) -> list[str]:
    """This process's temporary directories a rank removes if the launcher dies: the fork
    server's socket lives in multiprocessing's per-process directory."""
    if method != "forkserver":
        return []
    return [multiprocessing.util.get_temp_dir()]  # created now, so the fork server uses it


def _spawn(fn: Callable[..., T], world_size: int, args: tuple[Any, ...], timeout: float,
           backend: str | None, join_timeout: float | None, threads: int | None,
           start_method: str | None, grace: float, quiet: bool) -> list[T]:
    workdir = tempfile.mkdtemp(prefix="pipesched-")
    launcher = identity_of(os.getpid())
    cleanup = [workdir, *_owned_directories(_method(start_method))]
    # Before the fork server, whose start waits for its imports with SIGTERM free: from now
    # on nothing outlives this process
    reaper = Reaper(cleanup)
    processes: list[Any] = []
    try:
        context = _context(start_method)
        # A path, not a file:// URL: a '#', '?' or newline in TMPDIR would end or bend the
        # URL (the rendezvous escaped to a shorter path, went stale, later launches hung)
        rendezvous = os.path.join(workdir, "rendezvous")
        processes = [context.Process(target=worker, name=f"pipesched-rank-{rank}", args=(
            rank, world_size, rendezvous, backend or default_backend(world_size), timeout,
            threads, fn, args, workdir, launcher, cleanup, quiet)) for rank in range(world_size)]
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


def _interrupted(results: list[Result | None]) -> bool:
    """Whether a rank was interrupted (Ctrl-C) and none failed by itself."""
    kinds = {result[1].kind for result in results if result is not None and
             result[0] == "error"}
    return "interrupted" in kinds and not kinds & {"error", "exit"}
