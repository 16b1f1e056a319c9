"""`PipelineEngine`: validates everything up front, then runs each step's instruction stream."""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from pipeline.checkpoint.save import Stateful
from pipeline.device import default_device
from pipeline.errors import PipelineConfigError
from pipeline.launcher.torchrun_group import init_from_torchrun
from pipeline.model.module import PipelineModule
from pipeline.moe.expert_bias import aux_free_layers, update_expert_biases
from pipeline.moe.expert_parallel import parallelize_experts
from pipeline.moe.expert_tensor_parallel import split_experts_over_tensor_parallel
from pipeline.moe.interleave import has_expert_all_to_all
from pipeline.parallel.data_parallel import GradReducer
from pipeline.parallel.groups import ProcessGroups, create_process_groups
from pipeline.parallel.local_p2p import open_local_link
from pipeline.parallel.optimizer import OptimizerFactory
from pipeline.parallel.tensor.split_check import check_layers_split
from pipeline.parallel.topology import Topology
from pipeline.runtime.batch import join_microbatches
from pipeline.runtime.checks import check_engine_arguments, trainable_parameters
from pipeline.runtime.comm import Comm
from pipeline.runtime.config import EngineConfig
from pipeline.runtime.engine_state import EngineState
from pipeline.runtime.engine_step import StepRunner
from pipeline.runtime.finite import FiniteFlag
from pipeline.runtime.interpreter import Interpreter
from pipeline.runtime.loss_normalization import is_summed, plain_sum_problem, run_normalized
from pipeline.runtime.parallel_setup import needs_process_groups, resolve_topology, setup_training
from pipeline.runtime.schedule_setup import (
    check_agreement,
    fingerprint,
    forward_schedule,
    resolve_schedule,
)
from pipeline.runtime.shapes import ShapeBook
from pipeline.runtime.trace import StepStats, Trace
from pipeline.runtime.two_batch import two_batch_stages
from pipeline.runtime.whole_vocabulary import loss_for_last_stage
from pipeline.supervision.failure import Watchdog
from pipeline.supervision.faults import FaultPoints
from pipeline.supervision.progress import ProgressRecord
from schedules import Kind, Schedule

__all__ = ["PipelineEngine"]


class PipelineEngine(StepRunner, EngineState):
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
        if not init_from_torchrun(self.config.timeout):  # torchrun: from its environment
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
        if parallel.expert_tensor_parallel > 1 and groups is not None:  # experts over tp
            split_experts_over_tensor_parallel(module, groups)
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
            loss_fn=loss_for_last_stage(module, module.loss_fn, groups, topology.tp),
            optimizer_step=self.training.step, device=self.device,
            split_stages=frozenset(op.stage for op in self.schedule.streams[self.pp_rank]
                                   if op.kind is Kind.I),
            precision=parallel.precision, loss_scale=self.training.loss_scale,
            progress=self.progress, shares_loss=self.position.tp_rank == 0,
            overlap_grad_reduce=parallel.overlap_grad_reduce,
            free_sent_outputs=self.config.free_sent_outputs,
            interleave_pairs=has_expert_all_to_all(module),
            two_batch_stages=two_batch or frozenset())
        self._expert_bias_layers = aux_free_layers(module)
        """MoE layers whose aux-free bias moves after each step (`pipeline.moe.expert_bias`)."""
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
        update_expert_biases(self._expert_bias_layers,
                             None if self.groups is None else self.groups.dp_group,
                             None if self.groups is None or self.topology.tp == 1
                             else self.groups.tp_group)
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
