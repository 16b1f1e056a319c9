"""One engine step: agree on the batch, run the stream, share the loss, name a failure."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from pipeline.device import synchronize
from pipeline.errors import NonFiniteError, PipelineStepError
from pipeline.parallel.data_parallel import broadcast_buffers
from pipeline.parallel.small_reduce import small_all_reduce
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.runtime.batch_vote import agree_on_batch
from pipeline.runtime.checks import trainable_change_problem
from pipeline.runtime.engine_fields import EngineFields
from pipeline.runtime.finite import first_nonfinite, nonfinite_error
from pipeline.runtime.interpreter import InstructionFailed, StepState
from pipeline.runtime.pulled_batch import PulledHalf
from pipeline.runtime.trace import StepStats
from pipeline.supervision.failure import read_failure, report_failure
from pipeline.supervision.progress import StallError, explain_timeout
from schedules import Instruction, Schedule
from schedules.ir.grid import format_grid

__all__ = ["StepRunner"]


class StepRunner(EngineFields):
    """`PipelineEngine`'s step: `_run` one schedule's step on this rank."""

    def _prepare(self, m: int, inputs: Any, targets: Any,
                 data_iter: Iterator[tuple[Any, Any]] | None,
                 training: bool) -> tuple[list[Any] | PulledHalf | None,
                                          list[Any] | PulledHalf | None]:
        """This rank's microbatches, after every rank agreed that the batch is usable and on
        its layout (when it changed, this step's forward messages carry headers)."""
        agreed = agree_on_batch(self.comm, self.pp_rank, m, inputs, targets, data_iter,
                                training=training, first=self.is_first_stage(),
                                last=self.is_last_stage(),
                                varying=self.config.dynamic_shapes,
                                refusal=trainable_change_problem(self._trainable, self.module)
                                if training else None)
        self._shapes.begin_step(agreed.layout)
        return agreed.microbatches, agreed.targets

    def _run(self, schedule: Schedule, inputs: Any, targets: Any,
             data_iter: Iterator[tuple[Any, Any]] | None, *,
             training: bool) -> tuple[float, dict[int, Any]]:
        """Run one step of `schedule`; the mean loss (on every rank) and the last stage's
        outputs per microbatch (eval, on the rank holding it)."""
        m = schedule.num_microbatches
        self.progress.enter(f"{'train' if training else 'eval'}_batch of step "
                            f"{self.global_step + 1}", collective=True)
        # 1. This rank's microbatches; every rank agrees the batch is usable. The replicas
        #    take dp rank 0's buffers (DDP's broadcast_buffers).
        microbatches, split_targets = self._prepare(m, inputs, targets, data_iter, training)
        if self.config.parallel.broadcast_buffers and self.topology.gradient_replicas > 1 \
                and self.groups is not None:
            broadcast_buffers(list(self.module.buffers()), self.groups.dp_group)
        # 2. Run this rank's stream.
        # the key an F's layers seed their dropout streams from (`pipeline.model.layer_rng`)
        state = StepState(microbatches, split_targets, training, step=self.global_step,
                          first_microbatch=self.position.dp_rank * m)
        self._trace.restart()
        gathered_before = self._gather_seconds()
        stream = schedule.streams[self.pp_rank]
        try:
            self._interpreter.run(stream, state, streams=schedule.streams)
        except InstructionFailed as failed:
            cause = failed.__cause__ if isinstance(failed.__cause__, Exception) else failed
            if read_failure() is None:  # a collective that timed out: who stopped?
                cause = explain_timeout(cause, self.rank, range(dist.get_world_size()))
            raise self._failure(schedule, failed.step, failed.op, cause) from cause
        # 3. Wait for the sends, then share the loss with every rank.
        try:
            self.comm.wait_sends()
        except RuntimeError as error:
            raise self._failure(schedule, len(stream) - 1, stream[-1], error) from error
        synchronize(self.device)
        step_time = time.perf_counter() - self._trace.origin
        self._finite_flags = state.finite  # read only when the loss is not finite
        left = state.leftovers()
        if left:  # the validated schedule frees everything: anything left is an engine bug
            raise RuntimeError(f"internal error: the step ended holding {left}")
        self._shapes.end_step()
        self._last_schedule = schedule
        self.last_stats = StepStats(step_time, state.peak_activations, state.recv_wait,
                                    self._trace.spans,
                                    exposed_reduction=state.exposed_reduction,
                                    exposed_gather=self._gather_seconds() - gathered_before)
        if state.loss_sum is None:  # no STEP carried it: the loss is summed alone
            state.loss_sum = self._interpreter.loss_share(state)
            small_all_reduce(state.loss_sum, link=self.comm.local,
                             group=None if self.groups is None else self.groups.world_group)
        loss = state.loss_sum / self.topology.gradient_replicas  # mean over dp × cp shares
        self.progress.enter(f"between steps, after step {self.global_step + training}")
        return float(loss[0]), state.outputs

    def _gather_seconds(self) -> float:
        """Seconds blocked on ZeRO-1's parameter all-gathers so far (0 without ZeRO-1)."""
        optimizer = self.training.optimizer
        return optimizer.param_gather.wait_seconds \
            if isinstance(optimizer, ShardedOptimizer) else 0.0

    def _nonfinite(self, loss: float) -> NonFiniteError:
        """Where the step's inf/NaN first appeared, agreed over the pipeline (a collective)."""
        mine = first_nonfinite(self._finite_flags)
        found = [where for where in self.comm.all_gather_object(mine) if where is not None]
        error = nonfinite_error(min(found) if found else None, loss, self.global_step,
                                skipped=self.training.step.nonfinite)
        if error.stage >= 0:  # every rank raises it: the launcher names the stage's rank
            error.caused_by = self.comm.pipeline_ranks[  # type: ignore[attr-defined]
                self.schedule.placement[error.stage]]
        return error

    def _failure(self, schedule: Schedule, step: int, op: Instruction,
                 error: Exception) -> PipelineStepError:
        self.comm.drop_pending()
        self._shapes.abandon_step()
        detail = f"{type(error).__name__}: {error}"
        peer = read_failure()
        caused_by = None
        if peer is not None and peer.reporter != self.rank:
            caused_by = peer.rank
            message = f"rank {self.rank} stopped at instruction {op} because {peer.describe()}"
        elif isinstance(error, StallError) and error.culprit is not None:
            caused_by = error.culprit  # a rank that stopped progressing: every rank stops
            report_failure(error.culprit, None, f"stopped progressing ({detail})",
                           reporter=self.rank)
            message = f"rank {self.rank} timed out at instruction {op}: {detail}"
        else:
            report_failure(self.rank, str(op), detail)
            message = (f"rank {self.rank} (pipeline rank {self.pp_rank}) failed at instruction "
                       f"{op} (step {step} of its {schedule.name!r} stream): {detail}")
        grid = format_grid(schedule.streams, self.pp_rank, step)
        return PipelineStepError(f"{message}\n{grid}", rank=self.rank, instruction=str(op),
                                 step=step, caused_by=caused_by)
