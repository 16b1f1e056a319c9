"""The reaper does its work even when the launcher dies before the reaper has read a line of
what the launcher told it (the reaper process still starting: a loaded host, or a kill right
after a fast start-up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_REPO = str(Path(__file__).resolve().parents[2])
# A launcher that starts its reaper and stops it at once (before the reaper's Python has
# started: it has read nothing), names a rank to it, and dies.
_LAUNCHER = """
import os, signal, subprocess, sys
from pipeline.supervision.orphans import Reaper

reaper = Reaper([sys.argv[1]])
os.kill(reaper._process.pid, signal.SIGSTOP)
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                        stdout=subprocess.DEVNULL)
reaper.watch(rank.pid)
print(reaper._process.pid, rank.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_reaper_acts_on_what_a_launcher_dead_before_it_started_told_it(
        tmp_path: Path) -> None:
    # regression: the reaper left its loop as soon as it saw the launcher gone, unread lines
    # and all: a launcher SIGKILLed just after a fast start left its pipesched-* and pymp-*
    # directories (its fork server already ready, ranks started at once; 1 kill in 3)
    directory = tmp_path / "pipesched-run"
    directory.mkdir()
    # stdout only: the reaper and the rank hold the launcher's stderr after it dies
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(directory)],
                                stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": _REPO})
    assert launcher.stdout is not None
    told = launcher.stdout.readline()
    assert launcher.wait(120) == -signal.SIGKILL, told
    reaper, rank = (int(pid) for pid in told.split())
    try:
        os.kill(reaper, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while _running(reaper) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(reaper), "the reaper did not end"
        assert not _running(rank), "the rank the launcher named outlived it"
        assert not directory.exists(), "the launcher's directory outlived it"
    finally:
        for pid in (reaper, rank):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
