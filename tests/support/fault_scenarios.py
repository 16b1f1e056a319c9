"""Faults injected into launched jobs, and the check that the job ended cleanly: the launcher
raised `RankFailedError` naming the right rank, within a bound, every rank exited non-zero,
no process survived; after a kill during a save, a new job resumes from the last complete
checkpoint. Shared by `tests/supervision/test_faults.py` and `benchmarks/reliability_report.py`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline import PipelineEngine, PipelineModule, RankFailedError, launch
from pipeline.supervision import faults
from tests.support.fault_helpers import record_pid, surviving_ranks
from tests.support.pipeline_models import MODELS, Boom, Stall, mlp_layers

__all__ = ["SCENARIOS", "Outcome", "Scenario", "run_scenario"]

TIMEOUT = 4.0  # the engine's and the launcher's per-wait timeout in these jobs (seconds)
GRACE = 2.0  # seconds the other ranks get to stop by themselves once one failed
BOUND = 60.0  # how long a failing job may take to end, all of it (far above what it needs)


class SelfKill(nn.Module):
    """Identity that SIGKILLs its own process on its `on_call`-th forward: a rank lost
    mid-step with no chance to report (an OOM kill, a node failure)."""

    def __init__(self, on_call: int) -> None:
        super().__init__()
        self.on_call, self.calls = on_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.on_call:
            faults.kill_self()
        return x


def _train_with(bad: str, workdir: str) -> None:
    """3 ranks, 17 layers cut uniformly (6, 6, 5): layer 8, the bad one, is on rank 1."""
    record_pid(os.path.join(workdir, "pids"))
    layer: nn.Module = {"sigkill": SelfKill(on_call=2), "raise": Boom(fail_on=2),
                        "stall": Stall(seconds=120), "none": nn.Identity()}[bad]
    layers = mlp_layers()
    layers.insert(8, layer)
    engine = PipelineEngine(PipelineModule(layers, num_stages=3, loss_fn=MODELS["mlp"].loss,
                                           partition_method="uniform"),
                            schedule="1f1b", num_microbatches=4, timeout=TIMEOUT)
    for step in range(200):  # long enough for the parent to kill a rank from outside
        engine.train_batch(*MODELS["mlp"].batch(seed=step))
        if step == 1:
            Path(workdir, f"running-{dist.get_rank()}").touch()


def _save_with_fault(point: str, culprit: int, workdir: str) -> None:
    """2 ranks save step 1, then die at `point` while saving again (step 2, or step 1 over
    itself for the swap, which only a re-save reaches)."""
    record_pid(os.path.join(workdir, "pids"))
    engine = _checkpoint_engine()
    engine.train_batch(*MODELS["mlp"].batch(seed=0))
    engine.save_checkpoint(os.path.join(workdir, "ckpt"))
    if point != "checkpoint.swap":
        engine.train_batch(*MODELS["mlp"].batch(seed=1))
    if dist.get_rank() == culprit:
        engine.faults.arm(point, faults.kill_self)
    engine.save_checkpoint(os.path.join(workdir, "ckpt"))


def _checkpoint_engine() -> PipelineEngine:
    module = PipelineModule(mlp_layers(), num_stages=2, loss_fn=MODELS["mlp"].loss)
    return PipelineEngine(module, schedule="1f1b", num_microbatches=2, timeout=TIMEOUT,
                          optimizer=lambda params: torch.optim.Adam(params, lr=0.01))


def _resume(workdir: str) -> int:
    engine = _checkpoint_engine()
    return engine.load_checkpoint(os.path.join(workdir, "ckpt")).step


@dataclass(frozen=True)
class Scenario:
    """One injected fault and what a clean end looks like."""

    name: str
    world_size: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    culprit: int | None
    """The rank `RankFailedError.rank` must name (None: only the message is checked)."""
    message: str
    """Text the error must contain."""
    external_kill: int | None = None
    """Rank the parent SIGKILLs once it is training (as the OOM killer would)."""
    resumes_at: int | None = None
    """Step a new job must load from the checkpoint root afterwards."""


SCENARIOS = [
    Scenario("rank SIGKILLs itself mid-step", 3, _train_with, ("sigkill",), 1, "SIGKILL"),
    Scenario("rank raises mid-step", 3, _train_with, ("raise",), 1, "Boom: injected failure"),
    Scenario("parent SIGKILLs a training rank", 3, _train_with, ("none",), 2, "SIGKILL",
             external_kill=2),
    Scenario("rank stalls mid-step", 3, _train_with, ("stall",), None,
             "rank 1 holds the pipeline up"),
    *[Scenario(f"rank {culprit} killed at {point}", 2, _save_with_fault, (point, culprit),
               culprit, "SIGKILL", resumes_at=1)
      for point, culprit in (("checkpoint.file", 1), ("checkpoint.file", 0),
                             ("checkpoint.manifest", 0), ("checkpoint.commit", 0),
                             ("checkpoint.swap", 0), ("checkpoint.latest", 0))],
]


@dataclass(frozen=True)
class Outcome:
    scenario: str
    survived: bool
    """The job ended as it should (every check passed)."""
    problems: tuple[str, ...]
    seconds: float


def _kill_when_running(workdir: str, rank: int, stop: threading.Event) -> None:
    marker, pid_file = Path(workdir, f"running-{rank}"), Path(workdir, "pids", f"{rank}.pid")
    while not stop.is_set():
        if marker.exists() and pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
            return
        time.sleep(0.05)


def run_scenario(scenario: Scenario, workdir: str) -> Outcome:
    """Launch the scenario's job, inject its fault, and check how the job ended."""
    os.makedirs(workdir, exist_ok=True)
    stop = threading.Event()
    killer = None
    if scenario.external_kill is not None:
        killer = threading.Thread(target=_kill_when_running,
                                  args=(workdir, scenario.external_kill, stop), daemon=True)
        killer.start()
    problems = []
    start = time.monotonic()
    try:
        launch(scenario.fn, scenario.world_size, *scenario.args, workdir, timeout=TIMEOUT,
               join_timeout=BOUND, grace=GRACE)
        problems.append("the job finished without an error")
    except RankFailedError as error:
        if scenario.culprit is not None and error.rank != scenario.culprit:
            problems.append(f"named rank {error.rank}, not {scenario.culprit}")
        if scenario.message not in str(error):
            problems.append(f"message lacks {scenario.message!r}: {str(error)[:300]}")
        if any(code == 0 for code in error.exit_codes) or len(error.exit_codes) != \
                scenario.world_size:
            problems.append(f"exit codes {error.exit_codes}")
    finally:
        stop.set()
        if killer is not None:
            killer.join()
    seconds = time.monotonic() - start
    if seconds >= BOUND:
        problems.append(f"took {seconds:.0f} s: the join_timeout ended it, not the failure")
    left = surviving_ranks(os.path.join(workdir, "pids"))
    if left:
        problems.append(f"processes {left} outlived the job")
    if scenario.resumes_at is not None:
        steps = launch(_resume, 2, workdir, timeout=TIMEOUT, join_timeout=BOUND)
        if steps != [scenario.resumes_at] * 2:
            problems.append(f"resumed at steps {steps}, not {scenario.resumes_at}")
    return Outcome(scenario.name, not problems, tuple(problems), seconds)
