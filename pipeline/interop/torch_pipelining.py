"""Run pipesched schedules on torch.distributed.pipelining: its stages from our cut, its runtime
from our CSV.

torch (2.13) runs any schedule table through `_PipelineScheduleRuntime._load_csv`: a
"compute_only" table is lowered by torch's own passes (`_add_send_recv`, `_add_reduce_grad`),
a "compute_comms" table is run as written. `format_torch_csv` writes the first from a
compute-only `Schedule` and the second from a lowered one, so the same schedule can be run
by both engines and compared. The other direction needs no code here: `parse_torch_csv`
reads torch's tables into a `Schedule` that `PipelineEngine` runs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from pipeline.device import default_device
from pipeline.errors import PipelineConfigError
from pipeline.model.module import LossFn, PipelineModule, Stage
from pipeline.runtime.schedule_setup import resolve_schedule
from schedules import Schedule, format_torch_csv

__all__ = ["TorchCsvFormat", "torch_csv_format", "torch_runtime", "torch_stages"]

TorchCsvFormat = Literal["compute_only", "compute_comms"]


def torch_csv_format(schedule: Schedule) -> TorchCsvFormat:
    """The torch CSV format `format_torch_csv(schedule)` writes."""
    return "compute_comms" if schedule.lowered else "compute_only"


def torch_stages(module: PipelineModule, schedule: Schedule, *, rank: int | None = None,
                 device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None) -> list[PipelineStage]:
    """This rank's stages of `module`, placed as `schedule` places them, as torch
    `PipelineStage`s (in stage order).

    The schedule is checked against the module first, as `PipelineEngine` checks it (ranks,
    chunks, `validate`). The layers are built by `module.materialize` with the per-layer
    seeds, so torch trains the same weights as `PipelineEngine` and `pipeline.model.reference`;
    use a fresh `PipelineModule` (it holds the built stages).
    """
    try:
        resolve_schedule(schedule, module, None)
    except PipelineConfigError as error:
        raise PipelineConfigError(f"cannot build torch stages: {error}") from error
    rank = dist.get_rank(group) if rank is None else rank
    if not 0 <= rank < schedule.num_ranks:
        raise PipelineConfigError(f"rank {rank} is outside the schedule's ranks "
                                  f"0..{schedule.num_ranks - 1}")
    device = device or default_device()
    module.materialize(schedule.stages_of(rank), device)
    return [PipelineStage(_Positional(module.stage(stage)), stage, schedule.num_stages, device,
                          group=group) for stage in schedule.stages_of(rank)]


class _Positional(nn.Module):
    """A `Stage` called as torch calls a stage module: a tuple between stages arrives as
    positional arguments, and we pass it on as the one tuple value our layers take."""

    def __init__(self, stage: Stage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *args: Any) -> Any:
        return self.stage(args[0] if len(args) == 1 else args)


def torch_runtime(schedule: Schedule, stages: Sequence[PipelineStage],
                  csv_path: str | os.PathLike[str], *, loss_fn: LossFn | None,
                  **options: Any) -> _PipelineScheduleRuntime:
    """torch's `_PipelineScheduleRuntime` over `stages`, running `schedule` as saved at
    `csv_path` in torch's CSV (format by `torch_csv_format`).

    Every rank may pass the same path: each writes the same text atomically before loading.
    `options` go to the runtime (e.g. ``scale_grads=False`` for a summed loss).
    """
    if not stages:
        raise PipelineConfigError("torch_runtime needs this rank's stages (torch_stages)")
    num_ranks = stages[0].group_size
    if num_ranks != schedule.num_ranks:
        raise PipelineConfigError(f"the stages' process group has {num_ranks} ranks but "
                                  f"schedule {schedule.name!r} runs on {schedule.num_ranks}")
    path = Path(csv_path)
    scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    scratch.write_text(format_torch_csv(schedule))
    os.replace(scratch, path)
    runtime = _PipelineScheduleRuntime(list(stages), schedule.num_microbatches,
                                       loss_fn=loss_fn, **options)
    runtime._load_csv(str(path), format=torch_csv_format(schedule))
    return runtime
