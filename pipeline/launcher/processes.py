"""`launch(fn, world_size)`: run `fn` on local ranks (or in place under torchrun), fail as one.

Spawned ranks rendezvous through a file in a fresh temporary directory, so nothing needs a
port. When a rank fails, its watchdog peers end within a poll interval; the launcher kills
any rank still alive after a short grace, then raises one `RankFailedError` naming the rank
that failed first and the instruction it failed at.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pipeline.device import default_backend, process_group_timeout
from pipeline.errors import PipelineConfigError, RankFailedError
from pipeline.launcher.failure import (
    EXIT_PEER_FAILED,
    FailureRecord,
    report_failure,
    start_watchdog,
    stop_watchdog,
)

__all__ = ["launch"]

T = TypeVar("T")
_GRACE = 5.0  # seconds the other ranks get to stop by themselves once one has failed
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.optim", "pipeline.runtime.engine"]


def launch(fn: Callable[..., T], world_size: int, *args: Any, timeout: float = 300.0,
           backend: str | None = None, join_timeout: float | None = None,
           threads_per_rank: int | None = 1, start_method: str | None = None,
           grace: float | None = None) -> list[T]:
    """Run ``fn(*args)`` on `world_size` ranks with a process group set up; return the
    per-rank results (index = rank).

    Under torchrun (RANK and WORLD_SIZE set) `fn` runs in this process only, over env://,
    and the list holds this rank's result alone. `timeout` bounds every wait inside a step;
    `join_timeout` (None: unbounded) bounds the whole run, after which every rank is killed.
    Once a rank fails, the others get `grace` seconds (default min(5, timeout)) to stop by
    themselves and report, then are killed: a failed job ends within about that long.
    `fn` and `args` must be picklable (a module-level function) for spawned ranks.
    """
    _check_arguments(fn, world_size, timeout, backend, join_timeout, threads_per_rank,
                     start_method)
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int | float)
                              or not (math.isfinite(grace) and grace >= 0)):
        raise PipelineConfigError(f"launch: grace must be None or a finite number of seconds "
                                  f">= 0, got {grace!r}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return [_run_in_place(fn, world_size, args, timeout, backend, threads_per_rank)]
    try:  # fails at process start otherwise, with an error about pickling internals
        pickle.dumps((fn, args))
    except Exception as error:  # pickling raises many types; all mean the same here
        raise PipelineConfigError(
            f"fn={fn!r} and its args must be picklable to start spawned ranks ({error}); "
            "pass a module-level function and plain arguments, not a lambda or closure"
        ) from None
    return _spawn(fn, world_size, args, timeout, backend, join_timeout, threads_per_rank,
                  start_method, min(_GRACE, timeout) if grace is None else grace)


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
    if not positive(timeout):
        problems.append(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if join_timeout is not None and not positive(join_timeout):
        problems.append(f"join_timeout must be None or a finite number of seconds > 0, got "
                        f"{join_timeout!r}")
    if threads is not None and not count(threads):
        problems.append(f"threads_per_rank must be None or an int >= 1, got {threads!r}")
    methods = multiprocessing.get_all_start_methods()
    if start_method is not None and start_method not in methods:
        problems.append(f"start_method must be None or one of {methods}, got {start_method!r}")
    if backend is not None and not (isinstance(backend, str) and backend.lower() in
                                    dist.Backend.backend_list and
                                    dist.is_backend_available(backend.lower())):
        available = [name for name in ("gloo", "nccl", "mpi", "ucc")
                     if dist.is_backend_available(name)]
        problems.append(f"backend must be None or an available backend {available}, got "
                        f"{backend!r}")
    if problems:
        raise PipelineConfigError("launch: " + "; ".join(problems))


def _run_in_place(fn: Callable[..., T], world_size: int, args: tuple[Any, ...], timeout: float,
                  backend: str | None, threads: int | None) -> T:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise PipelineConfigError(f"launch(world_size={world_size}) runs under torchrun with "
                                  f"WORLD_SIZE={env_world}; make them agree")
    if threads:
        torch.set_num_threads(threads)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend or default_backend(), init_method="env://",
                                timeout=process_group_timeout(timeout))
    start_watchdog(dist.get_rank())
    try:
        return fn(*args)
    except BaseException as error:
        report_failure(dist.get_rank(), getattr(error, "instruction", None),
                       f"{type(error).__name__}: {error}")
        raise
    finally:
        stop_watchdog()
        if created:
            dist.destroy_process_group()


def _context(start_method: str | None) -> Any:
    method = start_method or ("forkserver" if sys.platform.startswith("linux") else "spawn")
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(_PRELOAD)  # ranks fork with torch already imported
    return context


def _spawn(fn: Callable[..., T], world_size: int, args: tuple[Any, ...], timeout: float,
           backend: str | None, join_timeout: float | None, threads: int | None,
           start_method: str | None, grace: float) -> list[T]:
    workdir = tempfile.mkdtemp(prefix="pipesched-")
    context = _context(start_method)
    init_method = f"file://{os.path.join(workdir, 'rendezvous')}"
    processes = [context.Process(target=_worker, name=f"pipesched-rank-{rank}", args=(
        rank, world_size, init_method, backend or default_backend(), timeout, threads, fn,
        args, workdir)) for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
        expired, first_failed = _supervise(processes, grace, join_timeout)
        results = [_read(workdir, rank) for rank in range(world_size)]
        codes = tuple(process.exitcode for process in processes)
        if any(code != 0 for code in codes):
            killed = _killed_first(results, codes, first_failed)
            if killed is not None and not expired:
                raise killed
            raise _failure_error(results, codes, join_timeout if expired else None)
        return [payload[1] for payload in results]  # type: ignore[index]
    finally:
        for process in processes:
            if process.pid is None:
                continue  # never started (a start failed): nothing to stop
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        shutil.rmtree(workdir, ignore_errors=True)


def _supervise(processes: list[Any], grace: float, join_timeout: float | None
               ) -> tuple[bool, list[int]]:
    """Wait for every rank; once one fails (or the deadline passes), kill the rest after
    `grace` seconds (at once on the deadline). Returns whether the deadline expired, and
    the ranks seen failing first (in the same wake-up)."""
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    failed_at: float | None = None
    first_failed: list[int] = []
    alive = list(processes)
    while alive:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            for process in alive:
                process.kill()
            return True, first_failed
        if failed_at is not None and now - failed_at >= grace:
            for process in alive:
                process.kill()
            return False, first_failed
        limits = [0.5] + ([deadline - now] if deadline is not None else []) + \
            ([failed_at + grace - now] if failed_at is not None else [])
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=max(0.0, min(limits)))
        ended = [p for p in alive if not p.is_alive()]
        for process in ended:
            alive.remove(process)
        if failed_at is None and any(p.exitcode != 0 for p in ended):
            failed_at = time.monotonic()
            first_failed = [processes.index(p) for p in ended if p.exitcode != 0]
    return False, first_failed


def _worker(rank: int, world_size: int, init_method: str, backend: str, timeout: float,
            threads: int | None, fn: Callable[..., Any], args: tuple[Any, ...],
            workdir: str) -> None:
    _die_with_parent()
    if threads:
        torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    payload: tuple[str, Any]
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=process_group_timeout(timeout))
        start_watchdog(rank, on_peer_failure=lambda record: _stopped(workdir, rank, record))
        payload = ("ok", fn(*args))
    except BaseException as error:  # report everything, including KeyboardInterrupt
        instruction = getattr(error, "instruction", None)
        report_failure(rank, instruction, f"{type(error).__name__}: {error}")
        caused_by = getattr(error, "caused_by", None)
        payload = ("error", {"message": f"{type(error).__name__}: {error}",
                             "instruction": instruction, "caused_by": caused_by,
                             "traceback": traceback.format_exc(), "time": time.time()})
        print(f"[pipesched] rank {rank}: {payload[1]['traceback']}", file=sys.stderr, flush=True)
    finally:
        stop_watchdog()
    _write(workdir, rank, payload)
    if dist.is_initialized():
        dist.destroy_process_group()
    if payload[0] != "ok":
        sys.exit(1)


def _stopped(workdir: str, rank: int, record: FailureRecord) -> None:
    _write(workdir, rank, ("error", {"message": f"stopped because {record.describe()}",
                                     "instruction": None, "caused_by": record.rank,
                                     "traceback": "", "time": time.time()}))
    print(f"[pipesched] rank {rank} stopping: {record.describe()}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_FAILED)  # the main thread may be blocked in a receive forever


def _die_with_parent() -> None:
    """Linux: have the kernel kill this rank if the launching process dies (no orphans)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _write(workdir: str, rank: int, payload: tuple[str, Any]) -> None:
    path = os.path.join(workdir, f"rank{rank}.result")
    try:
        data = pickle.dumps(payload)
    except Exception as error:  # an unpicklable result: report it instead of losing it
        data = pickle.dumps(("error", {"message": f"rank {rank}'s result cannot be pickled: "
                                       f"{error}", "instruction": None, "caused_by": None,
                                       "traceback": "", "time": time.time()}))
    with open(path + ".tmp", "wb") as handle:
        handle.write(data)
    os.replace(path + ".tmp", path)


def _read(workdir: str, rank: int) -> tuple[str, Any] | None:
    try:
        with open(os.path.join(workdir, f"rank{rank}.result"), "rb") as handle:
            payload: tuple[str, Any] = pickle.load(handle)
            return payload
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _killed_first(results: list[tuple[str, Any] | None], codes: tuple[int | None, ...],
                  first_failed: list[int]) -> RankFailedError | None:
    """A rank killed by a signal (SIGKILL, the OOM killer) reports nothing; if it was among
    the first to end, the errors of the others (a closed connection) are its consequence."""
    killed = [rank for rank in first_failed if results[rank] is None
              and (codes[rank] or 0) < 0]
    if not killed:
        return None
    rank = killed[0]
    number = -(codes[rank] or 0)
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = "an unknown signal"
    summary = ", ".join(f"rank {r}: exit {code}" for r, code in enumerate(codes))
    return RankFailedError(f"rank {rank} was killed by signal {number} ({name}) without "
                           f"reporting an error; every other rank was stopped ({summary})",
                           rank=rank, exit_codes=codes)


def _failure_error(results: list[tuple[str, Any] | None], codes: tuple[int | None, ...],
                   join_timeout: float | None) -> RankFailedError:
    """One error naming the rank that failed first: a rank's own error before a rank that
    died without a word, before ranks stopped because of another."""
    own = [(info["time"], rank, info) for rank, result in enumerate(results)
           if result is not None and result[0] == "error"
           for info in [result[1]] if info["caused_by"] is None]
    silent = [rank for rank, result in enumerate(results) if result is None and codes[rank]]
    summary = ", ".join(f"rank {r}: exit {code}" for r, code in enumerate(codes))
    if own:
        _, rank, info = min(own, key=lambda item: (item[0], item[1]))
        where = f" at instruction {info['instruction']}" if info["instruction"] else ""
        return RankFailedError(
            f"rank {rank} failed{where}: {info['message']}\n({summary})\n"
            f"--- traceback of rank {rank} ---\n{info['traceback']}", rank=rank,
            instruction=info["instruction"], exit_codes=codes)
    if silent:
        rank = silent[0]
        code = codes[rank]
        why = (f"did not finish within join_timeout={join_timeout}s and was killed"
               if join_timeout is not None else "was killed after another rank failed"
               if code is not None and code < 0 else
               f"exited with code {codes[rank]} without reporting an error")
        return RankFailedError(f"rank {rank} {why} ({summary})", rank=rank, exit_codes=codes)
    caused = [result[1]["caused_by"] for result in results if result is not None and
              result[0] == "error"]
    rank = caused[0] if caused else 0
    return RankFailedError(f"rank {rank} failed (reported by the other ranks) ({summary})",
                           rank=rank, exit_codes=codes)
