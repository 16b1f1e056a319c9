"""Killing the launcher ends the job: SIGKILL or SIGTERM of a process running `launch` (any
start method, or torchrun's agent) leaves no rank, fork server, resource tracker or
temporary directory behind, and no rank goes on writing checkpoints."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.orphan_job import KILL_POINTS, kill_launcher

pytestmark = pytest.mark.multiprocess


def _checkpoints(workdir: Path) -> list[str]:
    root = workdir / "ckpt"
    return sorted(os.listdir(root)) if root.exists() else []


@pytest.mark.parametrize(("start_method", "signal_number"), [
    ("forkserver", signal.SIGKILL), ("forkserver", signal.SIGTERM),
    ("spawn", signal.SIGKILL), ("fork", signal.SIGTERM)],
    ids=["forkserver-SIGKILL", "forkserver-SIGTERM", "spawn-SIGKILL", "fork-SIGTERM"])
def test_killing_the_launcher_orphans_nothing(start_method: str, signal_number: int,
                                              tmp_path: Path) -> None:
    # regression: 0/10 kills cleaned up; ranks and the fork server kept training and saving
    outcome = kill_launcher(str(tmp_path), start_method, signal_number)
    assert outcome.started, outcome.problems
    assert outcome.clean, outcome.problems
    written = _checkpoints(tmp_path)
    time.sleep(1.0)
    assert _checkpoints(tmp_path) == written  # nobody saves any more


_SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}
_CHEAP = {("importing", "SIGINT"), ("importing", "SIGTERM"), ("importing", "SIGKILL"),
          ("starting", "SIGINT"), ("unpickling", "SIGKILL"), ("rendezvous", "SIGTERM"),
          ("first-step", "SIGKILL")}  # each point and each signal once; the rest are slow


@pytest.mark.parametrize(("point", "signal_number"), [
    pytest.param(point, number, id=f"{point}-{name}",
                 marks=() if (point, name) in _CHEAP else pytest.mark.slow)
    for point in KILL_POINTS if point != "training" for name, number in _SIGNALS.items()])
def test_killing_the_launcher_during_start_up_orphans_nothing(point: str, signal_number: int,
                                                              tmp_path: Path) -> None:
    # regression: 13/57 start-up kills left a rank (blocked in torch's FileStore holding the
    # GIL, so its watch thread never ran), the fork server and the resource tracker for ~5
    # minutes, and stray pipesched-*/pymp-* directories; and SIGINT / SIGTERM were held while
    # the fork server imported torch (15 s on a loaded host; here its import never ends)
    outcome = kill_launcher(str(tmp_path), "forkserver", signal_number, point)
    assert outcome.started, outcome.problems
    assert outcome.clean, outcome.problems
    assert not outcome.traceback, (tmp_path / "stderr.txt").read_text()[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("signal_number", [signal.SIGKILL, signal.SIGTERM],
                         ids=["SIGKILL", "SIGTERM"])
def test_killing_torchrun_orphans_nothing(signal_number: int, tmp_path: Path) -> None:
    # SIGKILL: the agent cannot act, the ranks see it go; SIGTERM: the agent stops the
    # ranks itself (its own traceback is its way of saying so) and they remove its log dir
    outcome = kill_launcher(str(tmp_path), "torchrun", signal_number)
    assert outcome.started, outcome.problems
    assert outcome.clean, outcome.problems
