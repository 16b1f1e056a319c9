"""What the engine holds beyond a step: optimizer, gradients, checkpoints, timeline."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import torch

from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.save import CheckpointInfo, CheckpointParts, Stateful, save_checkpoint
from pipeline.parallel.rank_optimizer import RankOptimizer
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.runtime.engine_fields import EngineFields
from pipeline.runtime.parallel_setup import optimizer_state_bytes, reduced_gradients
from pipeline.runtime.trace import merge_rank_spans
from pipeline.runtime.zero_setup import checkpoint_regions
from schedules import Timeline

__all__ = ["EngineState"]


class EngineState(EngineFields):
    """`PipelineEngine`'s optimizer, gradients, checkpoints and measurements."""

    loss_scaler: Stateful | None

    # -- 3D parallelism --------------------------------------------------------------------

    @property
    def optimizer(self) -> RankOptimizer | None:
        """A torch optimizer, or the `ShardedOptimizer` under ZeRO-1 (a torch optimizer too,
        holding the factory's groups: torch's LR schedulers take either); None: nothing to
        step. STEP steps whatever is set here."""
        return self.training.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: RankOptimizer | None) -> None:
        self.finish_param_gather()  # the replaced one's gathers write the parameters
        self.training.optimizer = optimizer

    def finish_param_gather(self) -> None:
        """Complete ZeRO-1's parameter all-gathers left in flight by the last step
        (`overlap_param_gather`); afterwards every parameter holds its updated value. The
        engine's forwards and checkpoints do this themselves; call it before reading the
        module's parameters any other way (a no-op otherwise)."""
        if isinstance(self.training.optimizer, ShardedOptimizer):
            self.training.optimizer.finish_param_gather()

    @property
    def last_step_skipped(self) -> bool:
        """fp16: whether the last step was skipped for an overflow (on every rank alike)."""
        return self.training.step.skipped

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1 except under fp16)."""
        return self.training.loss_scale()

    def reduced_gradients(self) -> dict[tuple[int, str], torch.Tensor]:
        """(layer, name) -> the reduced gradient the last step used; under ZeRO-1 gathered
        from the shards (a collective over the dp group: call it on every rank)."""
        return reduced_gradients(self.module, self.optimizer)

    def optimizer_state_bytes(self) -> int:
        """Bytes of this rank's optimizer state (1/dp of it under ZeRO-1)."""
        return optimizer_state_bytes(self.optimizer)

    # -- checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, directory: str, *,
                        extra_files: Mapping[str, bytes] | None = None) -> CheckpointInfo:
        """Save weights (per global layer), optimizer state (per parameter, ZeRO shards with
        their offsets), loss scaler, generators and `global_step` under
        ``directory/step_<global_step>/`` and point ``directory/latest`` at it, crash-safely
        (a collective: every rank calls it). See `pipeline.checkpoint.save`. `extra_files`
        (name -> bytes) go into the step directory too, listed and signed in its manifest."""
        self.progress.enter("save_checkpoint", collective=True)
        parts = self._checkpoint_parts()
        parts.extra_files = dict(extra_files or {})
        info = save_checkpoint(directory, parts)
        self.progress.enter(f"between steps, after step {self.global_step}")
        return info

    def load_checkpoint(self, directory: str, *, load_optimizer: bool = True) -> CheckpointInfo:
        """Load a checkpoint root (following ``latest``) or one step directory, saved under
        any partition and data-parallel size; restores `global_step`. Refuses a missing,
        corrupt or torn checkpoint with `CheckpointError` before changing anything."""
        info = load_checkpoint(directory, self._checkpoint_parts(),
                               load_optimizer=load_optimizer)
        self.global_step = info.step
        return info

    def _checkpoint_parts(self) -> CheckpointParts:
        optimizer: Any = self.optimizer
        regions = checkpoint_regions(self.module, self.training.tied, optimizer)  # ZeRO 1-3
        return CheckpointParts(
            module=self.module, topology=self.topology, rank=self.rank, step=self.global_step,
            optimizer=optimizer, zero_params_by_stage=regions,
            loss_scaler=self.loss_scaler, schedule=self.schedule.name,
            num_microbatches=self.schedule.num_microbatches, faults=self.faults)

    # -- measurements ----------------------------------------------------------------------

    def last_timeline(self) -> Timeline:
        """Every pipeline rank's measured spans of the last step, in seconds from the step's
        start, as the simulator's `Timeline` (a collective: call it on every rank).

        Ranks on one host share the monotonic clock, so their spans are placed on it
        exactly; across hosts each rank's clock starts at the step's opening collective.
        """
        gathered = self.comm.all_gather_object(
            (socket.gethostname(), self._trace.origin, self._trace.spans))
        return merge_rank_spans(gathered, self._last_schedule)
