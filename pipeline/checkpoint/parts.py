"""What one rank puts into a checkpoint (`CheckpointParts`) and where it went (`CheckpointInfo`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pipeline.model.module import PipelineModule
from pipeline.parallel.topology import Topology
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.supervision.faults import FaultPoints

__all__ = ["CheckpointInfo", "CheckpointParts", "Stateful"]


class Stateful(Protocol):
    """Anything with torch-style `state_dict` / `load_state_dict` (the loss scaler)."""

    def state_dict(self) -> dict[str, float]: ...

    def load_state_dict(self, state: dict[str, float]) -> None: ...


@dataclass
class CheckpointParts:
    """What one rank puts into, and takes back from, a checkpoint."""

    module: PipelineModule
    """The module, materialized with this rank's stages."""
    topology: Topology
    rank: int
    """This process's global rank."""
    step: int = 0
    """Optimizer steps taken so far (the engine's `global_step`)."""
    optimizer: torch.optim.Optimizer | ShardedOptimizer | None = None
    zero_params_by_stage: Mapping[int, Sequence[nn.Parameter]] | None = None
    """With a `ShardedOptimizer`: the `params_by_stage` it was built with (its layout)."""
    loss_scaler: Stateful | None = None
    schedule: str = ""
    num_microbatches: int = 1
    faults: FaultPoints | None = None
    """Fault points a test armed for this save (the engine passes its `faults`)."""
    extra_files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    """More files this rank writes into the step directory, by name: listed (and signed) in
    the manifest with the role 'client' (the DeepSpeed layer's client state)."""

    def reach(self, point: str) -> None:
        """Fire `point` if a test armed it (see `pipeline.supervision.faults`)."""
        if self.faults is not None:
            self.faults.reach(point)

    @property
    def layers(self) -> dict[int, nn.Module]:
        """This rank's layers by global index."""
        return {int(key): layer for stage in self.module.stages
                for key, layer in self.module.stage(int(stage)).layers.items()}

    @property
    def optimizer_kind(self) -> str:
        if isinstance(self.optimizer, ShardedOptimizer):
            return "zero"
        return "none" if self.optimizer is None else "torch"

    @property
    def optimizer_class(self) -> str:
        inner = self.optimizer.optimizer if isinstance(self.optimizer, ShardedOptimizer) \
            else self.optimizer
        return "" if inner is None else type(inner).__name__


@dataclass(frozen=True)
class CheckpointInfo:
    """Where a checkpoint went (or came from) and what it restored."""

    directory: str
    """The step directory."""
    step: int
    rng_restored: bool = False
    """False after a load into another topology (each rank keeps its own generators)."""
