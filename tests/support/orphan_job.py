"""A launcher to kill: `python -m tests.support.orphan_job WORKDIR START_METHOD [POINT]` launches
2 ranks that train and save a checkpoint every step until stopped (under torchrun it runs in
place), or that stop at a start-up POINT (`KILL_POINTS`) until killed:

- ``importing``: the fork server is still importing its preloads (one that never ends
  stands for torch's import on a loaded host), the launcher waiting for it;
- ``starting``: the launcher has had a rank forked but not yet learnt its pid;
- ``unpickling``: both ranks block, before `launch`'s worker runs, in a C call holding the
  GIL (so no Python thread of theirs runs);
- ``rendezvous``: one rank blocks so, the other waits for it in the file rendezvous;
- ``first-step``: the process group is up; one rank blocks so in `fn`, the other waits for
  it in the first step's receive;
- ``training``: both ranks train and save (the default).

Shared by `tests/supervision/test_orphans.py` and `benchmarks/reliability_report.py`, which kill
this process and check that no rank, fork server or temporary directory outlives it.
"""

from __future__ import annotations

import ctypes
import glob
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, launch
from pipeline.launcher import processes as launcher_processes
from tests.support import endless_import
from tests.support.pipeline_models import MODELS, mlp_layers

__all__ = ["KILL_POINTS", "KillOutcome", "kill_launcher"]

KILL_POINTS = ("importing", "starting", "unpickling", "rendezvous", "first-step", "training")

_REPO = str(Path(__file__).resolve().parents[2])
_START = 180.0  # seconds the job may take to start training on a loaded machine
_GONE = 30.0  # seconds every process of the job may take to end once the launcher is gone


def _block_holding_the_gil(workdir: str, label: str) -> None:
    """Mark that this process got here, then block in C without releasing the GIL (PyDLL
    keeps it), as torch's FileStore does while it retries a missing file."""
    Path(workdir, f"blocked-{label}-{os.getpid()}").touch()
    ctypes.PyDLL(None).pause()


class _Blocker:
    """An argument of `fn` whose unpickling in a new rank blocks: every rank (``unpickling``)
    or the first rank to claim it (``rendezvous``), before `launch`'s worker runs."""

    def __init__(self, workdir: str, point: str) -> None:
        self.workdir, self.point = workdir, point

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__dict__.update(state)
        if self.point == "unpickling":
            _block_holding_the_gil(self.workdir, "unpickling")
        if self.point == "rendezvous":
            try:
                os.close(os.open(os.path.join(self.workdir, "claimed"),
                                 os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return  # the other rank blocks; this one goes on to the rendezvous
            _block_holding_the_gil(self.workdir, "rendezvous")


def _train_forever(workdir: str, blocker: _Blocker | None = None) -> None:
    rank = dist.get_rank()
    if blocker is not None and blocker.point == "first-step":
        Path(workdir, f"in-fn-{rank}").touch()
        if rank == 1:
            _block_holding_the_gil(workdir, "first-step")
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=MODELS["mlp"].loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2, timeout=60)
    Path(workdir, "pids").mkdir(exist_ok=True)
    Path(workdir, "pids", f"{rank}.pid").write_text(str(os.getpid()))
    while True:
        engine.train_batch(*MODELS["mlp"].batch(seed=engine.global_step))
        engine.save_checkpoint(os.path.join(workdir, "ckpt"))
        Path(workdir, f"running-{rank}").touch()


@dataclass(frozen=True)
class KillOutcome:
    started: bool
    """The job reached training before the kill."""
    clean: bool
    """Every process of the job ended, and the temporary directory was left empty."""
    hung: bool
    """Some process of the job was still running `_GONE` seconds after the kill."""
    traceback: bool
    """A process of the job printed a Python traceback after the kill (not a clean end)."""
    seconds: float
    """From the kill until every process of the job had ended (or `_GONE`)."""
    problems: tuple[str, ...]


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _running(processes: list[psutil.Process]) -> list[int]:
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _reached(workdir: str, point: str) -> bool:
    """Whether the job stopped at (or, for ``training``, reached) `point`."""
    def marks(pattern: str) -> int:
        return len(glob.glob(os.path.join(workdir, pattern)))
    if point == "importing":
        return marks("importing") == 1
    if point == "starting":
        return marks("starting") == 1
    if point == "unpickling":
        return marks("blocked-unpickling-*") == 2
    if point == "rendezvous":
        return marks("blocked-rendezvous-*") == 1 and marks("tmp/pipesched-*/rendezvous") == 1
    if point == "first-step":
        return marks("blocked-first-step-*") == 1 and marks("in-fn-0") == 1
    return marks("running-*") == 2


def _collect(job: dict[int, psutil.Process], pid: int) -> None:
    """Add `pid`'s descendants, and those of every process already in `job`, to `job`."""
    for root in [pid, *job]:
        for process in _descendants(root):
            job.setdefault(process.pid, process)


def kill_launcher(workdir: str, start_method: str, signal_number: int,
                  point: str = "training") -> KillOutcome:
    """Start the job (`start_method` "torchrun": under torchrun), wait until it reaches
    `point` (one of `KILL_POINTS`), send the launcher `signal_number`, and check what
    outlives it."""
    if point not in KILL_POINTS:
        raise ValueError(f"point must be one of {KILL_POINTS}, got {point!r}")
    temporary = os.path.join(workdir, "tmp")
    os.makedirs(temporary, exist_ok=True)
    env = {**os.environ, "TMPDIR": temporary, "PYTHONPATH": _REPO}
    module = ["-m", "tests.support.orphan_job", workdir, start_method, point]
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "--module", *module[1:]]
               if start_method == "torchrun" else [sys.executable, *module])
    log_path = os.path.join(workdir, "stderr.txt")
    log = open(log_path, "wb")  # the job's stderr, its ranks' too
    launcher = subprocess.Popen(command, env=env, cwd=_REPO, stdout=subprocess.DEVNULL,
                                stderr=log)
    written_before_kill = 0
    problems: list[str] = []
    found: dict[int, psutil.Process] = {}
    job: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + _START
        while not _reached(workdir, point):
            if time.monotonic() > deadline or launcher.poll() is not None:
                return KillOutcome(False, False, False, False, 0.0,
                                   (f"the job did not reach {point}",))
            time.sleep(0.05)
        _collect(found, launcher.pid)
        written_before_kill = os.path.getsize(log_path)
        killed_at = time.monotonic()
        launcher.send_signal(signal_number)
        while launcher.poll() is None and time.monotonic() < killed_at + _GONE:
            _collect(found, launcher.pid)  # ranks it still starts (a held SIGINT) count too
            time.sleep(0.02)
        job = list(found.values())
        while _running(job) and time.monotonic() < killed_at + _GONE:
            _collect(found, launcher.pid)
            job = list(found.values())
            time.sleep(0.05)
        seconds = time.monotonic() - killed_at
        left = _running(job)
        if left:
            problems.append(f"processes {left} outlived the launcher")
        time.sleep(0.5)  # a rank's last removal may still be under way
        # torch keeps its compile cache in TMPDIR/torchinductor_<user> on purpose, across runs
        leftovers = [name for name in os.listdir(temporary)
                     if not name.startswith("torchinductor_")]
        if leftovers:
            problems.append(f"left in the temporary directory: {leftovers}")
        traceback = b"Traceback" in Path(log_path).read_bytes()[written_before_kill:]
        return KillOutcome(True, not problems, bool(left), traceback, seconds, tuple(problems))
    finally:
        for process in [*job, psutil.Process(launcher.pid)] if launcher.poll() is None else job:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        launcher.wait(timeout=_GONE)
        log.close()


def _import_forever(workdir: str) -> None:
    """Give the fork server, after its first preload (the guard), one that never ends."""
    os.environ[endless_import.MARK_ENV] = os.path.join(workdir, "importing")
    preloads = launcher_processes._PRELOAD
    launcher_processes._PRELOAD = (preloads[0], endless_import.__name__, *preloads[1:])


def _pause_after_fork(workdir: str) -> None:
    """Make the launcher's first fork-server start stop after the fork, before it learns
    the new rank's pid (where an interrupted `Process.start` would lose the rank)."""
    read_signed = multiprocessing.forkserver.read_signed

    def read_then_pause(fd: int) -> int:
        value = read_signed(fd)
        if not Path(workdir, "starting").exists():
            Path(workdir, "starting").touch()
            time.sleep(3.0)
        return value

    multiprocessing.forkserver.read_signed = read_then_pause


if __name__ == "__main__":
    directory, method = sys.argv[1], sys.argv[2]
    stop_at = sys.argv[3] if len(sys.argv) > 3 else "training"
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in `pipesched train`
    if stop_at == "importing":
        _import_forever(directory)
    if stop_at == "starting":
        _pause_after_fork(directory)
    blocking = (None if stop_at in ("importing", "starting", "training")
                else _Blocker(directory, stop_at))
    try:
        launch(_train_forever, 2, directory, blocking, timeout=60,
               start_method=None if method == "torchrun" else method)
    except KeyboardInterrupt:  # as `pipesched train` does: one line, exit 130
        print("interrupted", file=sys.stderr)
        sys.exit(130)
