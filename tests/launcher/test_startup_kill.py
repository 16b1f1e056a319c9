"""A launcher killed (SIGTERM) while its fork server still imports its preloads ends at once,
and the fork server with it (issue 49 item 6: under load the launcher held SIGTERM / SIGINT
until the fork server had imported torch, 15 s, with its ranks' start deferred)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_REPO = str(Path(__file__).resolve().parents[2])
_LAUNCHER = """
import sys
from multiprocessing import forkserver
from pipeline.launcher import processes

processes._PRELOAD = ("pipeline.launcher.forkserver_guard", "slow_preload",
                      "pipeline.launcher.forkserver_ready")
print("launching", flush=True)
processes.launch(print, 1, timeout=30)
"""
_SLOW = "import time\ntime.sleep(40)  # a fork server importing torch on a loaded host\n"


def _forkserver_of(launcher: int) -> list[int]:
    children = Path(f"/proc/{launcher}/task/{launcher}/children")
    return [int(pid) for pid in children.read_text().split()] if children.exists() else []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux's")
def test_a_launcher_terminated_while_its_fork_server_imports_ends_at_once(
        tmp_path: Path) -> None:
    (tmp_path / "slow_preload.py").write_text(_SLOW)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_REPO, str(tmp_path)])}
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE,
                                text=True, env=env)
    assert launcher.stdout is not None and launcher.stdout.readline() == "launching\n"
    deadline = time.monotonic() + 20
    while not _forkserver_of(launcher.pid):  # the fork server started: it is importing
        assert time.monotonic() < deadline, "no fork server started"
        time.sleep(0.05)
    children = _forkserver_of(launcher.pid)
    time.sleep(1.0)  # the launcher is past starting the fork server, waiting on it
    launcher.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        launcher.wait(20)  # held until the 40 s import ended, before the fix
    finally:
        if launcher.poll() is None:
            launcher.kill()
            for pid in children:
                os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - started < 10
    assert launcher.returncode == -signal.SIGTERM
    for pid in children:  # the kernel kills the fork server with its launcher
        for _ in range(50):
            if not Path(f"/proc/{pid}").exists() or "Z" in Path(
                    f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"process {pid} outlived its terminated launcher")
