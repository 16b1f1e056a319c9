"""Launches from a worker thread beside the main thread's: the fork server they share
outlives the thread that happened to start it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_REPO = str(Path(__file__).resolve().parents[2])

# A fresh interpreter: the fork server must not be running yet, so that the two launches
# race to start it (the pool thread's launch usually wins the server's own lock while the
# main thread's launch is inside its start-up).
_SCRIPT = textwrap.dedent("""
    from concurrent.futures import ThreadPoolExecutor
    import torch.distributed as dist
    from pipeline import launch

    rank = dist.get_rank  # importable in the ranks (a function of -c's __main__ is not)

    for attempt in range(2):
        with ThreadPoolExecutor(1) as pool:
            threaded = pool.submit(launch, rank, 2, timeout=120)
            assert launch(rank, 2, timeout=120) == [0, 1]
            assert threaded.result(timeout=240) == [0, 1]
        # the pool's thread has ended: the next launch still reaches the fork server
        assert launch(rank, 2, timeout=120) == [0, 1]
    print("ok", flush=True)
""")


@pytest.mark.multiprocess
def test_a_launch_from_a_thread_that_ends_leaves_the_fork_server_running() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": _REPO})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
