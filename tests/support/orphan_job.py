"""A launcher to kill: `python -m tests.support.orphan_job WORKDIR START_METHOD` launches 2 ranks
that train and save a checkpoint every step until stopped (under torchrun it runs in place).

Shared by `tests/launch/test_orphans.py` and `benchmarks/reliability_report.py`, which kill
this process and check that no rank, fork server or temporary directory outlives it.
"""

from __future__ import annotations

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
from tests.support.pipeline_models import MODELS, mlp_layers

__all__ = ["KillOutcome", "kill_launcher"]

_REPO = str(Path(__file__).resolve().parents[2])
_START = 180.0  # seconds the job may take to start training on a loaded machine
_GONE = 30.0  # seconds every process of the job may take to end once the launcher is gone


def _train_forever(workdir: str) -> None:
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=MODELS["mlp"].loss)
    engine = PipelineEngine(module, schedule="1f1b", num_microbatches=2, timeout=60)
    rank = dist.get_rank()
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


def kill_launcher(workdir: str, start_method: str, signal_number: int) -> KillOutcome:
    """Start the job (`start_method` "torchrun": under torchrun), wait until both ranks
    train, send the launcher `signal_number`, and check what outlives it."""
    temporary = os.path.join(workdir, "tmp")
    os.makedirs(temporary, exist_ok=True)
    env = {**os.environ, "TMPDIR": temporary, "PYTHONPATH": _REPO}
    module = ["-m", "tests.support.orphan_job", workdir, start_method]
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "--module", *module[1:]]
               if start_method == "torchrun" else [sys.executable, *module])
    log_path = os.path.join(workdir, "stderr.txt")
    log = open(log_path, "wb")  # the job's stderr, its ranks' too
    launcher = subprocess.Popen(command, env=env, cwd=_REPO, stdout=subprocess.DEVNULL,
                                stderr=log)
    written_before_kill = 0
    problems: list[str] = []
    job: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + _START
        while not all(Path(workdir, f"running-{r}").exists() for r in range(2)):
            if time.monotonic() > deadline or launcher.poll() is not None:
                return KillOutcome(False, False, False, False, 0.0,
                                   ("the job did not start training",))
            time.sleep(0.1)
        job = _descendants(launcher.pid)
        written_before_kill = os.path.getsize(log_path)
        killed_at = time.monotonic()
        launcher.send_signal(signal_number)
        launcher.wait(timeout=_GONE)
        while _running(job) and time.monotonic() < killed_at + _GONE:
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


if __name__ == "__main__":
    directory, method = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    launch(_train_forever, 2, directory, timeout=60,
           start_method=None if method == "torchrun" else method)
