"""torch.distributed.pipelining's own schedule tables, made without a process group (test helper).

torch builds a schedule's table in its constructor from the stages' rank and group size
only, so stand-in stages (autospec mocks, as torch's `_schedule_visualizer` uses) give the
exact table a real run would use.
"""

from __future__ import annotations

import csv
import importlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal
from unittest import mock

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import PipelineStage

__all__ = ["dump_torch_csv", "pipelining_schedules", "stand_in_stages", "torch_rows"]


def pipelining_schedules() -> ModuleType:
    """`torch.distributed.pipelining.schedules`, imported when a test runs: importing it costs
    seconds, which collecting the suite should not pay."""
    return importlib.import_module("torch.distributed.pipelining.schedules")


def stand_in_stages(p: int, v: int) -> list[PipelineStage]:
    """v stand-ins for rank 0's stages in a p-rank group with p·v stages."""
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p * v
    return [stage] * v


def torch_rows(name: str, p: int, m: int, *, with_comms: bool) -> list[list[str | None]]:
    """torch's actions for schedule class `name` (v = 2), as text (None: idle)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    actions = get_schedule_ops(name, p, m, 2, with_comms=with_comms)
    return [[None if a is None else str(a) for a in rank] for rank in actions]


def dump_torch_csv(name: str, p: int, m: int, path: Path,
                   form: Literal["compute_only", "compute_comms"]) -> None:
    """Write the CSV torch's schedule class `name` (e.g. "ZBVZeroBubble", "GPipe") dumps.

    Multi-stage classes write it with their own `_dump_csv` in either format; single-stage
    ones (GPipe, 1F1B) have no `_dump_csv` and only a compute-only table, written here as
    `_dump_csv` would (csv rows of action text, idle slots empty).
    """
    torch_schedules = pipelining_schedules()
    cls = torch_schedules.get_schedule_class(name)
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        if form != "compute_only":
            raise ValueError(f"torch's {cls.__name__} has no {form} table")
        schedule = cls(stand_in_stages(p, 1)[0], m, loss_fn=_no_loss)
        order = schedule._get_pipeline_order() or {}
        with open(path, "w", newline="") as handle:
            csv.writer(handle).writerows(order[rank] for rank in sorted(order))
        return
    runtime = cls(stand_in_stages(p, 2), m, loss_fn=_no_loss)
    runtime._dump_csv(str(path), format=form)


def _no_loss(outputs: object, targets: object) -> object:
    return outputs
