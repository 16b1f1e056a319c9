"""What every instruction handler reads: the rank's stages, channels and step, and its waits."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pipeline.model.module import LossFn, PipelineModule, Stage
from pipeline.parallel.data_parallel import GradReducer
from pipeline.parallel.optimizer_step import OptimizerStep
from pipeline.parallel.precision import Precision
from pipeline.runtime.comm import Comm, PendingRecv
from pipeline.runtime.send_release import MessageKey
from pipeline.runtime.shapes import ShapeBook
from pipeline.runtime.step_state import StepState
from pipeline.runtime.trace import Trace
from pipeline.supervision.progress import ProgressRecord, StallError, explain_stall
from schedules import Kind

__all__ = ["InterpreterBase"]

_T = TypeVar("_T")
_now = time.perf_counter


class InterpreterBase:
    """The interpreter's fields (set by `Interpreter.__init__`, documented there) and the
    waits on a peer that the compute and message handlers share."""

    module: PipelineModule
    pp_rank: int
    placement: tuple[int, ...]
    last_stage: int
    m: int
    comm: Comm
    shapes: ShapeBook
    trace: Trace
    reducer: GradReducer
    loss_fn: LossFn | None
    _loss_checked: bool
    optimizer_step: OptimizerStep
    shares_loss: bool
    device: torch.device
    precision: Precision
    loss_scale: Callable[[], float]
    split_stages: frozenset[int]
    free_sent_outputs: bool
    stages: dict[int, Stage]
    stage_params: dict[int, list[nn.Parameter]]
    state: StepState
    progress: ProgressRecord
    two_batch: dict[int, frozenset[int]]
    two_batch_handovers: int
    op_start: float
    _witnesses: tuple[object, dict[MessageKey, list[MessageKey]]]

    def _local(self, stage: int) -> bool:
        return 0 <= stage <= self.last_stage and self.placement[stage] == self.pp_rank

    def _blocked(self, peer: int, what: str, wait: Callable[[], _T]) -> _T:
        """Run `wait` (blocked on data from pipeline rank `peer`); on a timeout, ask the other
        ranks what they do and say which one holds the pipeline up."""
        rank = self.comm.pipeline_ranks[peer]
        self.progress.wait_on(rank)
        try:
            result = wait()
        except RuntimeError as error:
            # every rank, not only this pipeline's: the rank at the end of the waits may be
            # blocked in a tp collective or an expert all-to-all with a rank of another one
            ranks = range(dist.get_world_size()) if dist.is_initialized() \
                else self.comm.pipeline_ranks
            stall = explain_stall(self.progress.rank, list(ranks), rank)
            why = f"; {stall.explanation}" if stall.explanation else ""
            raise StallError(f"no data from pipeline rank {peer} (global rank {rank}) for "
                             f"{what}: {error}{why}", culprit=stall.culprit) from error
        self.progress.wait_on(None)
        return result

    def _wait(self, pending: PendingRecv, kind: Kind, stage: int,
              microbatch: int) -> list[torch.Tensor]:
        start = _now()
        tensors = self._blocked(pending.peer, f"{stage}{kind.value}{microbatch}", pending.wait)
        proven = self._witnesses[1].get((kind, stage, microbatch))
        if proven:  # the peer posted the receives of these sends: they are taken
            self.comm.release(proven)
        end = _now()
        self.trace.record(kind, stage, microbatch, start, end)
        self.state.recv_wait += end - start
        self.op_start = end
        return tensors

