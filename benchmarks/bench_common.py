"""Helpers the benchmarks share."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["deepspeed_available", "timed_step", "torch_schedule_step"]


def deepspeed_available(wanted: bool, without: str) -> bool:
    """True when DeepSpeed is wanted and importable; otherwise say `without` on stderr."""
    if not wanted:
        return False
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print(f"DeepSpeed is not installed: {without}", file=sys.stderr)
        return False
    return True


def torch_schedule_step(runner: Any, stages: Sequence[Any], optimizer: torch.optim.Optimizer
                        ) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step of a `torch.distributed.pipelining` schedule on this rank's
    `stages`: the first stage feeds the input, the last the target, then the optimizer."""
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        args = (x,) if first else ()
        if last:
            runner.step(*args, target=y, losses=[])
        else:
            runner.step(*args)
        optimizer.step()
    return step


def timed_step(step: Callable[[], None]) -> float:
    """Seconds of one `step` on every rank (barriers around it)."""
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start
