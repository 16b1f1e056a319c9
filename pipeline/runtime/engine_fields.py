"""What the engine's parts read: its fields, and the facts DeepSpeed users look for."""

from __future__ import annotations

import torch

from pipeline.model.module import PipelineModule
from pipeline.parallel.groups import ProcessGroups
from pipeline.parallel.topology import RankPosition, Topology
from pipeline.runtime.comm import Comm
from pipeline.runtime.config import EngineConfig
from pipeline.runtime.finite import FiniteFlag
from pipeline.runtime.interpreter import Interpreter
from pipeline.runtime.parallel_setup import TrainingRuntime
from pipeline.runtime.shapes import ShapeBook
from pipeline.runtime.trace import StepStats, Trace
from pipeline.supervision.faults import FaultPoints
from pipeline.supervision.progress import ProgressRecord
from schedules import Schedule

__all__ = ["EngineFields"]


class EngineFields:
    """`PipelineEngine`'s fields (set and documented by its `__init__`) and the facts about
    this rank's stages; the step runner and the state accessors build on it."""

    config: EngineConfig
    rank: int
    topology: Topology
    position: RankPosition
    pp_rank: int
    schedule: Schedule
    progress: ProgressRecord
    faults: FaultPoints
    device: torch.device
    module: PipelineModule
    groups: ProcessGroups | None
    training: TrainingRuntime
    _trainable: frozenset[tuple[int, str]]
    comm: Comm
    _shapes: ShapeBook
    _trace: Trace
    _interpreter: Interpreter
    _last_schedule: Schedule
    _finite_flags: list[FiniteFlag]
    last_stats: StepStats | None
    global_step: int

    # -- facts DeepSpeed users look for ----------------------------------------------------

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    @property
    def stage_ids(self) -> tuple[int, ...]:
        """The stages this rank holds."""
        return self.schedule.stages_of(self.pp_rank)

    def is_first_stage(self) -> bool:
        return 0 in self.stage_ids

    def is_last_stage(self) -> bool:
        return self.schedule.num_stages - 1 in self.stage_ids
