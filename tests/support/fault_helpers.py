"""Helpers for tests that kill ranks: record each rank's pid, check none outlived the job."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import torch.distributed as dist

__all__ = ["record_pid", "surviving_ranks"]


def record_pid(directory: str) -> None:
    """Called first thing in a rank: leaves ``<directory>/<rank>.pid``."""
    os.makedirs(directory, exist_ok=True)
    Path(directory, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))


def surviving_ranks(directory: str) -> list[int]:
    """Pids recorded by `record_pid` whose process still runs (zombies count as gone)."""
    alive = []
    for path in Path(directory).glob("*.pid"):
        pid = int(path.read_text())
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive
