"""torch's pipelining schedules without a process group: stand-in stages, their orders, a timer."""

from __future__ import annotations

import time
import types
from typing import Any

__all__ = ["stand_in_stages", "timed", "torch_order"]


def stand_in_stages(p: int, v: int) -> list[Any]:
    """What torch's schedule constructors read from a stage, without a process group."""
    return [types.SimpleNamespace(num_stages=p * v, group_size=p, group_rank=0, submod=None,
                                  stage_index=c * p, is_first=c == 0,
                                  is_last=c * p == p * v - 1) for c in range(v)]


def timed(make: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    value = make()
    return time.perf_counter() - start, value


def torch_order(instance: Any, p: int) -> list[list[str | None]]:
    return [[None if a is None else str(a) for a in instance.pipeline_order[r]]
            for r in range(p)]
