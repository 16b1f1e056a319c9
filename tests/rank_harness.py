"""Run a function on N gloo ranks in child processes, with a hard deadline (test helper)."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

__all__ = ["run_ranks"]

# forkserver, not spawn: the server imports torch once and every rank forks from it, so a
# 4-rank test pays one torch import instead of four on the 2 shared cores. The server never
# runs a torch op, so no thread pool is forked (the hazard of plain fork).
_START_METHOD = "forkserver"
multiprocessing.get_context(_START_METHOD).set_forkserver_preload(["torch", "torch.distributed"])


def _rank_main(rank: int, fn: Callable[..., None], world_size: int, init_file: str,
               args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], world_size: int, tmp_path: Path, *args: Any,
              timeout: float = 90.0) -> None:
    """Call `fn(rank, world_size, *args)` on `world_size` ranks; fail on error or timeout.

    `fn` must be a module-level function (it is pickled by name). An exception in any rank
    is re-raised here with that rank's traceback.
    """
    init_file = str(tmp_path / f"rendezvous-{time.monotonic_ns()}")
    context = torch_mp.start_processes(
        _rank_main, args=(fn, world_size, init_file, args), nprocs=world_size, join=False,
        start_method=_START_METHOD)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{getattr(fn, '__name__', fn)} on {world_size} ranks did not finish "
                        f"within {timeout:.0f} s (deadlock?)")
