"""`PipelineEngine`: validates everything up front, then runs each step's instruction stream."""

from __future__ import annotations

import math
import socket
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from pipeline.checkpoint.load import load_checkpoint
from pipeline.checkpoint.save import CheckpointInfo, CheckpointParts, Stateful, save_checkpoint
from pipeline.device import default_device, synchronize
from pipeline.errors import NonFiniteError, PipelineConfigError, PipelineStepError
from pipeline.model.module import PipelineModule
from pipeline.moe.expert_parallel import parallelize_experts
from pipeline.moe.interleave import has_expert_all_to_all
from pipeline.parallel.data_parallel import GradReducer, broadcast_buffers
from pipeline.parallel.groups import ProcessGroups, create_process_groups
from pipeline.parallel.local_p2p import open_local_link
from pipeline.parallel.optimizer import OptimizerFactory
from pipeline.parallel.rank_optimizer import RankOptimizer
from pipeline.parallel.small_reduce import small_all_reduce
from pipeline.parallel.tensor.split_check import check_layers_split
from pipeline.parallel.topology import Topology
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.runtime.batch import (
    join_microbatches,
)
from pipeline.runtime.batch_vote import agree_on_batch
from pipeline.runtime.checks import (
    check_engine_arguments,
    trainable_change_problem,
    trainable_parameters,
)
from pipeline.runtime.comm import Comm
from pipeline.runtime.config import EngineConfig
from pipeline.runtime.finite import FiniteFlag, first_nonfinite, nonfinite_error
from pipeline.runtime.interpreter import InstructionFailed, Interpreter, StepState
from pipeline.runtime.loss_normalization import is_summed, plain_sum_problem, run_normalized
from pipeline.runtime.parallel_setup import (
    needs_process_groups,
    optimizer_state_bytes,
    reduced_gradients,
    resolve_topology,
    setup_training,
    zero_regions,
)
from pipeline.runtime.pulled_batch import PulledHalf
from pipeline.runtime.schedule_setup import (
    check_agreement,
    fingerprint,
    forward_schedule,
    resolve_schedule,
)
from pipeline.runtime.shapes import ShapeBook
from pipeline.runtime.trace import StepStats, Trace, merge_rank_spans
from pipeline.runtime.two_batch import two_batch_stages
from pipeline.supervision.failure import Watchdog, read_failure, report_failure
from pipeline.supervision.faults import FaultPoints
from pipeline.supervision.progress import ProgressRecord, StallError, explain_timeout
from schedules import Instruction, Kind, Schedule, Timeline
from schedules.ir.grid import format_grid

__all__ = ["PipelineEngine"]


class PipelineEngine:
    """Trains (and evaluates) a `PipelineModule` with a pipeline schedule, one call per batch.

    Construct it on every rank with the same arguments, inside `launch` or under torchrun
    (any initialised process group). It checks that the ranks agree, builds this rank's
    stages, and then `train_batch` runs this rank's lowered instruction stream.

    What it runs is one typed value, `EngineConfig` (schedule, microbatches, timeout, and a
    `ParallelConfig`: dp / tp sizes, `ZeroStage`, precision, clipping); the keyword form
    ``PipelineEngine(module, schedule="1f1b", num_microbatches=8, zero_stage=1)`` builds it
    from the fields' names. The objects it is handed stay arguments: the optimizer (or a
    factory), a `Topology` (else pp × dp × tp from the world size), process groups, a
    gradient reducer and the device.
    """

    def __init__(self, module: PipelineModule, config: EngineConfig | None = None, *,
                 optimizer: OptimizerFactory | torch.optim.Optimizer | None = None,
                 topology: Topology | None = None, groups: ProcessGroups | None = None,
                 gradient_reducer: GradReducer | None = None,
                 device: torch.device | None = None, **options: Any) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine needs a PipelineModule, got {type(module).__name__}")
        if config is not None and options:
            raise PipelineConfigError(f"pass either config= or the options {sorted(options)} "
                                      f"(EngineConfig fields), not both")
        if config is not None and not isinstance(config, EngineConfig):
            raise PipelineConfigError(f"config must be an EngineConfig, got {config!r}")
        self.config = config if config is not None else EngineConfig.from_options(**options)
        """What this engine was told (validated on construction)."""
        check_engine_arguments(optimizer=optimizer, topology=topology, groups=groups,
                               gradient_reducer=gradient_reducer, device=device)
        if not dist.is_initialized():
            raise PipelineConfigError("no process group: run inside pipeline.launch(fn, "
                                      "world_size) or torchrun, or call "
                                      "torch.distributed.init_process_group first")
        parallel = self.config.parallel
        # 1. The grid (pp × dp × tp = world size) and this rank's place in it.
        world, self.rank = dist.get_world_size(), dist.get_rank()
        topology = resolve_topology(world, module.num_stages, topology, parallel)
        self.topology = topology
        self.position = topology.position(self.rank)
        self.pp_rank = self.position.pp_rank
        # 2. The schedule: fits the module, validates, and every rank agrees on it (this
        #    rank's watchdog runs from here: it answers stall probes from `progress`).
        self.schedule = resolve_schedule(self.config.schedule, module,
                                         self.config.num_microbatches)
        self.eval_schedule = forward_schedule(self.schedule)
        self.progress = ProgressRecord(self.rank)
        """What this rank does now (phase, instruction, wait): names it when it stalls."""
        self.faults = FaultPoints()
        """Fault points a test can arm in this engine's checkpoint saves."""
        self._watchdog = Watchdog(self.rank, progress=self.progress, delay=1.0).start()
        weakref.finalize(self, self._watchdog.stop)
        self.progress.enter("engine set-up", collective=True)
        prints: list[Any] = [None] * world
        dist.all_gather_object(prints, fingerprint(module, self.schedule, world, {
            "dynamic_shapes": self.config.dynamic_shapes,
            "two_batch_overlap": self.config.two_batch_overlap,
            "topology": (topology.pp, topology.dp, topology.cp, topology.tp),
            "parallel": repr(parallel)}))
        check_agreement(prints, list(range(world)))
        self.progress.enter("engine set-up")
        # 3. This rank's groups, stages (tp layers get their group), reducer, optimizer,
        #    STEP and channels.
        self.device = device or default_device()
        self.module = module
        if groups is None and needs_process_groups(topology, parallel):
            groups = create_process_groups(topology)
        self.groups = groups
        """pp/dp/tp process groups (None for a pure pipeline: the world is the pipeline)."""
        module.materialize(self.schedule.stages_of(self.pp_rank), self.device, groups=groups)
        if topology.ep > 1 and groups is not None:  # each MoE layer keeps its 1/ep experts
            parallelize_experts(module, groups)
        check_layers_split(((int(key), layer) for stage in self.stage_ids
                            for key, layer in module.stage(stage).layers.items()), topology.tp)
        # over the world (not the pipeline group): STEP's vote spans every rank
        local = open_local_link(None, self.config.timeout) \
            if self.config.local_p2p and self.device.type == "cpu" else None
        self.training = setup_training(module, self.schedule.placement, topology, groups,
                                       parallel, optimizer, gradient_reducer, link=local)
        """Reducer, optimizer, tied-weight sync, loss scaler and STEP of this rank."""
        self._warn_no_optimizer = optimizer is None and self.rank == 0
        """train_batch without an optimizer computes gradients only: said once, by rank 0."""
        self._trainable = trainable_parameters(module)
        """What the buckets and the optimizer were built over: a training step refuses a
        change (`trainable_change_problem`)."""
        pipeline_group = groups.pp_group if groups is not None else None
        self.gradient_reducer = self.training.reducer
        self.comm = Comm(self.position.pipeline_ranks, self.device, pipeline_group,
                         self.config.timeout, local=local)
        self._shapes = ShapeBook(always_dynamic=self.config.dynamic_shapes)
        self._trace = Trace(self.pp_rank)
        two_batch = two_batch_stages(module, self.stage_ids, self.device) \
            if self.config.two_batch_overlap else None
        self._interpreter = Interpreter(
            module=module, pp_rank=self.pp_rank, placement=self.schedule.placement,
            num_microbatches=self.schedule.num_microbatches, comm=self.comm,
            shapes=self._shapes, trace=self._trace, reducer=self.gradient_reducer,
            loss_fn=module.loss_fn, optimizer_step=self.training.step, device=self.device,
            split_stages=frozenset(op.stage for op in self.schedule.streams[self.pp_rank]
                                   if op.kind is Kind.I),
            precision=parallel.precision, loss_scale=self.training.loss_scale,
            progress=self.progress, shares_loss=self.position.tp_rank == 0,
            overlap_grad_reduce=parallel.overlap_grad_reduce,
            free_sent_outputs=self.config.free_sent_outputs,
            interleave_pairs=has_expert_all_to_all(module),
            two_batch_stages=two_batch or frozenset())
        self._last_schedule: Schedule = self.schedule
        self._finite_flags: list[FiniteFlag] = []
        self.last_stats: StepStats | None = None
        """What this rank measured in the last step (None before the first)."""
        self.last_loss: float | None = None
        """Mean loss of the last `eval_batch` given targets."""
        self.global_step = 0
        """Optimizer steps taken (`train_batch` calls); saved and restored by checkpoints."""
        self.loss_scaler: Stateful | None = self.training.scaler
        """The fp16 loss scaler, when mixed precision uses one (checkpointed with the rest)."""
        self.progress.enter("between steps, after step 0")

    def stop_watchdog(self) -> None:
        """Stop this engine's failure watchdog (at the end of a script that owns its process
        group: before destroying the group the watchdog polls)."""
        self._watchdog.stop()

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

    # -- steps -----------------------------------------------------------------------------

    def train_batch(self, inputs: Any = None, targets: Any = None, *,
                    data_iter: Iterator[tuple[Any, Any]] | None = None) -> float:
        """One optimizer step on a full batch; returns the mean loss on every rank.

        The batch is split into `num_microbatches` equal microbatches (or, as in DeepSpeed,
        `data_iter` yields them as (inputs, targets) pairs, pulled one at a time as the step
        loads each, so only the microbatches in flight are alive: the ranks holding the
        first or the last stage pull m pairs per step, the others none); gradients
        accumulate as a single process would for the mean loss over the full batch. Only
        the ranks holding the first stage need inputs, the last stage targets. Pulled
        microbatches share the first one's layout unless the engine has
        ``dynamic_shapes=True``; a short iterator or a misshapen pair after the first fails
        the step when it is pulled (the first is checked before anything runs).

        A loss that sums over items and counts them (`loss_normalization.SummedLoss`, e.g.
        ``token_cross_entropy()``) is normalised by the step's total item count, so loss and
        gradients are the single-process mean over every item; one that sums without a
        count is refused.
        """
        if self.module.loss_fn is None:  # known on every rank: all refuse before any message
            raise PipelineConfigError("train_batch needs a loss: build the module with "
                                      "PipelineModule(layers, num_stages, loss_fn=...) "
                                      "(eval_batch runs without one)")
        self._check_reduction()
        if self._warn_no_optimizer:
            self._warn_no_optimizer = False
            warnings.warn("train_batch without an optimizer: the step computes and reduces "
                          "gradients (engine.reduced_gradients()) but never updates the "
                          "weights; pass PipelineEngine(..., optimizer=lambda params: "
                          "torch.optim.SGD(params, lr=0.1)) to train", stacklevel=2)
        if is_summed(self.module.loss_fn):
            loss: float = run_normalized(self, self._train_step, inputs, targets, data_iter)
            return loss
        return self._train_step(inputs, targets, data_iter=data_iter)

    def _check_reduction(self) -> None:
        problem = plain_sum_problem(self.module.loss_fn)  # same on every rank: all refuse
        if problem is not None:
            raise PipelineConfigError(problem)

    def _train_step(self, inputs: Any = None, targets: Any = None, *,
                    data_iter: Iterator[tuple[Any, Any]] | None = None) -> float:
        """`train_batch` with the loss as the module gives it (no normalisation)."""
        self.module.train()
        self.module.zero_grad(set_to_none=True)
        loss, _ = self._run(self.schedule, inputs, targets, data_iter, training=True)
        self.global_step += 1
        step = self.training.step
        if (not math.isfinite(loss) or step.nonfinite) and self.config.on_nonfinite == "raise":
            raise self._nonfinite(loss)  # same branch on every rank: both facts are global
        return loss

    def eval_batch(self, inputs: Any = None, targets: Any = None, *,
                   data_iter: Iterator[tuple[Any, Any]] | None = None) -> Any:
        """Forward the full batch with the forward-only schedule (no gradients).

        Returns the last stage's outputs, joined over microbatches, on the rank that holds
        the last stage (None elsewhere); with targets, the mean loss is in `last_loss` (item
        weighted for a summed loss, as in `train_batch`).
        """
        if targets is not None or data_iter is not None:
            self._check_reduction()
            if is_summed(self.module.loss_fn):
                return run_normalized(self, self._eval_step, inputs, targets, data_iter)
        return self._eval_step(inputs, targets, data_iter=data_iter)

    def _eval_step(self, inputs: Any = None, targets: Any = None, *,
                   data_iter: Iterator[tuple[Any, Any]] | None = None) -> Any:
        """`eval_batch` with the loss as the module gives it (no normalisation)."""
        was_training = self.module.training
        self.module.eval()
        try:
            loss, outputs = self._run(self.eval_schedule, inputs, targets, data_iter,
                                      training=False)
            self.last_loss = loss if targets is not None or data_iter is not None else None
        finally:
            self.module.train(was_training)
        if not outputs:
            return None
        return join_microbatches([outputs[i] for i in range(len(outputs))])

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
        if self.topology.cp > 1:  # the files are laid out per dp rank, not dp × cp
            raise PipelineConfigError(f"checkpoints do not run with context_parallel="
                                      f"{self.topology.cp} yet; save from a context_parallel=1 "
                                      "job, or export with save_hf_checkpoint")
        optimizer: Any = self.optimizer
        regions = (zero_regions(self.module, self.training.tied)
                   if isinstance(optimizer, ShardedOptimizer) else None)
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
