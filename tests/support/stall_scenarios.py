"""Stalled ranks (SIGSTOPped mid-step, slow in engine set-up, slow before a checkpoint save)
and the check that the job fails naming the stalled rank. Shared by
`tests/supervision/test_stalls.py` and `benchmarks/reliability_report.py`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipeline import PipelineEngine, PipelineModule, RankFailedError, launch
from tests.support.fault_helpers import record_pid, surviving_ranks
from tests.support.pipeline_models import MODELS, mlp_layers

__all__ = ["STALLS", "StallOutcome", "run_stall"]

TIMEOUT = 6.0  # the launcher's and the engine's per-wait timeout (seconds)
GRACE = 2.0
BOUND = 120.0  # join_timeout: far above timeout + probe patience + grace
STALLED = 1  # the rank that stalls
_SLOW = 600.0  # how long a slow rank sleeps: it must be stopped, not waited for


def _engine() -> PipelineEngine:
    module = PipelineModule(mlp_layers(), num_stages=3, loss_fn=MODELS["mlp"].loss,
                            partition_method="uniform")
    return PipelineEngine(module, schedule="1f1b", num_microbatches=4, timeout=TIMEOUT)


def _train(where: str, workdir: str) -> None:
    """3 ranks train; rank `STALLED` stalls `where`: "sigstop" (the parent stops it once
    every rank trains), "step" (it stops itself as its third optimizer step begins: the
    others time out in the step's collective), "setup" (sleeps before building its engine),
    "save" (sleeps while the others enter `save_checkpoint`)."""
    record_pid(os.path.join(workdir, "pids"))
    rank = dist.get_rank()
    if where == "setup" and rank == STALLED:
        time.sleep(_SLOW)
    engine = _engine()
    if where == "step" and rank == STALLED:
        step = engine.training.step  # the test reaches in: stop at an exact moment
        vote = step.vote

        def stop_at_third_step(riders: Any = None) -> bool:
            if engine.global_step == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            return vote(riders)
        step.vote = stop_at_third_step  # type: ignore[method-assign]
    for step in range(400):
        engine.train_batch(*MODELS["mlp"].batch(seed=step))
        if step == 1:
            Path(workdir, f"running-{rank}").touch()
        if where == "save" and step == 2:
            if rank == STALLED:
                time.sleep(_SLOW)
            engine.save_checkpoint(os.path.join(workdir, "ckpt"))


STALLS = {"sigstop": "rank SIGSTOPped mid-step",
          "step": "rank SIGSTOPped in the optimizer step's collective",
          "setup": "rank slow in engine set-up",
          "save": "rank slow before save_checkpoint"}


@dataclass(frozen=True)
class StallOutcome:
    named: bool
    """RankFailedError named the stalled rank (as `rank` and in the message)."""
    hung: bool
    """Only the join_timeout ended the job."""
    clean: bool
    """Every rank exited non-zero and none outlived the job."""
    error: str


def _stop_when_running(workdir: str, world_size: int, stop: threading.Event) -> None:
    pid_file = Path(workdir, "pids", f"{STALLED}.pid")
    while not stop.is_set():
        if pid_file.exists() and all(Path(workdir, f"running-{r}").exists()
                                     for r in range(world_size)):
            os.kill(int(pid_file.read_text()), signal.SIGSTOP)
            return
        time.sleep(0.05)


def run_stall(where: str, workdir: str) -> StallOutcome:
    """Launch 3 ranks, stall rank 1 `where`, and check how the job ended."""
    os.makedirs(workdir, exist_ok=True)
    stop = threading.Event()
    stopper = threading.Thread(target=_stop_when_running, args=(workdir, 3, stop), daemon=True)
    if where == "sigstop":
        stopper.start()
    text, named, codes = "the job finished without an error", False, ()
    try:
        launch(_train, 3, where, workdir, timeout=TIMEOUT, join_timeout=BOUND, grace=GRACE)
    except RankFailedError as error:
        text, codes = str(error), error.exit_codes
        named = error.rank == STALLED and f"rank {STALLED}" in text.splitlines()[0]
    finally:
        stop.set()
        if stopper.is_alive():
            stopper.join()
    hung = "join_timeout" in text
    clean = len(codes) == 3 and all(code != 0 for code in codes) and \
        not surviving_ranks(os.path.join(workdir, "pids"))
    return StallOutcome(named and not hung, hung, clean, text)
