"""Run a per-rank check on N gloo ranks through `pipeline.launcher` (test helper)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from pipeline import launch

__all__ = ["run_ranks"]


def _with_rank(fn: Callable[..., None], *args: Any) -> None:
    fn(dist.get_rank(), dist.get_world_size(), *args)


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any,
              timeout: float = 90.0) -> None:
    """Call `fn(rank, world_size, *args)` on `world_size` ranks; any rank's error, or the
    whole run passing `timeout` seconds, fails the test (`launch` kills every rank).

    `fn` must be a module-level function (it is pickled by name).
    """
    launch(_with_rank, world_size, fn, *args, timeout=60.0, join_timeout=timeout)
