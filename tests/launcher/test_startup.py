"""Start-up: the fork server does not outlive a killed launcher while it still imports
torch, a Ctrl-C while it starts is not lost, and a Ctrl-C during the CLI's imports is one
line, not a traceback."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import pipeline.cli
from pipeline.cli import EXIT_INTERRUPTED, main
from pipeline.launcher import processes

_REPO = str(Path(__file__).resolve().parents[2])
_LAUNCHER = """
import time
from pipeline.launcher.processes import _context

print("starting", flush=True)
_context(None)  # starts the fork server, and waits while it imports torch
time.sleep(600)
"""


def _fork_server_of(launcher: int) -> int:
    """The fork server `launcher` starts (waits for it to appear)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if "multiprocessing.forkserver import main" in " ".join(child.cmdline()):
                    return child.pid
        time.sleep(0.02)
    raise AssertionError("the launcher started no fork server")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.startswith("State:") and "Z" in line for line in status)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_fork_server_dies_with_a_launcher_killed_while_it_imports_torch() -> None:
    # regression: it outlived a SIGKILLed launcher for 15.6-18 s (importing torch first)
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": _REPO})
    assert launcher.stdout is not None and launcher.stdout.readline() == "starting\n"
    server = _fork_server_of(launcher.pid)  # just started: it imports torch for seconds
    launcher.kill()
    launcher.wait(30)
    # the kernel kills it as the launcher dies; 2 s is far above that and far below the
    # import of torch it was still in (the old fork server noticed only after it)
    for _ in range(20):
        if _gone(server):
            break
        time.sleep(0.1)
    else:
        os.kill(server, signal.SIGKILL)
        pytest.fail(f"the fork server {server} outlived its killed launcher")


def test_a_ctrl_c_while_the_fork_server_starts_is_not_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # regression: SIGINT was ignored (so discarded) while the fork server started
    from multiprocessing import forkserver

    monkeypatch.setattr(forkserver, "ensure_running",
                        lambda: os.kill(os.getpid(), signal.SIGINT))  # Ctrl-C mid-start
    with pytest.raises(KeyboardInterrupt):
        processes._start_fork_server_deaf_to_ctrl_c()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_the_cli_imports_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # regression: a Ctrl-C while the command's modules imported printed a traceback
    def interrupted(command: str | None = None) -> object:
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.cli, "build_parser", interrupted)
    assert main(["plan", "--help"]) == EXIT_INTERRUPTED
    assert capsys.readouterr().err == "pipesched plan: interrupted\n"
