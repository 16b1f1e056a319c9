"""3D parallel setup: the pp × dp × cp × tp grid, tied weights, dp / ZeRO-1 reduction, precision.

The engine calls, on every rank in the same order (every step below that creates a group
or communicates is collective):

    config   = ParallelConfig(...)                      # validated on construction
    topology = resolve_topology(world, num_stages, topology, config)
    groups   = create_process_groups(topology)          # if needs_process_groups(...)
    module.materialize(stages, device, groups=groups)   # tp layers get groups.tp_group
    runtime  = setup_training(module, placement, topology, groups, config, optimizer)

`setup_training` follows the building blocks' protocol: tied groups and synchroniser; dp
replicas and tied copies start from one value (broadcasts); the reducer (bucketed
all-reduce, or ZeRO-1's reduce-scatter, wrapped to sum tied gradients first) and the STEP
callable (overflow vote, clipping, step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.errors import PipelineConfigError
from pipeline.model.module import PipelineModule
from pipeline.parallel.config import ParallelConfig, ZeroStage
from pipeline.parallel.data_parallel import (
    BucketedGradReducer,
    GradReducer,
    NoOpGradReducer,
    broadcast_parameters,
    make_grad_reducer,
)
from pipeline.parallel.expert_clipping import ExpertReplicatedGrads
from pipeline.parallel.expert_reduction import (
    ExpertSplitReducer,
    broadcast_split,
    split_expert_parameters,
)
from pipeline.parallel.groups import ProcessGroups, check_world_size
from pipeline.parallel.local_p2p import LocalLink
from pipeline.parallel.optimizer import OptimizerFactory, make_optimizer
from pipeline.parallel.optimizer_step import (
    GradientView,
    OptimizerStep,
    ReplicatedGrads,
    ShardedGrads,
)
from pipeline.parallel.partial_grad_reducer import defer_partial_sums
from pipeline.parallel.precision import DynamicLossScaler, half_dtype
from pipeline.parallel.rank_optimizer import RankOptimizer
from pipeline.parallel.tied_sync import (
    TiedGradReducer,
    TiedWeightSynchronizer,
    create_tied_groups,
)
from pipeline.parallel.topology import Topology, TopologyError
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.runtime.zero_setup import shard_stages, zero_regions

__all__ = [
    "TrainingRuntime",
    "needs_process_groups",
    "optimizer_state_bytes",
    "reduced_gradients",
    "resolve_topology",
    "setup_training",
    "zero_regions",
]


def resolve_topology(world_size: int, num_stages: int, topology: Topology | None,
                     config: ParallelConfig) -> Topology:
    """The pp × dp × cp × tp grid, checked against the world size, the module and the ZeRO
    stage."""
    pp, tp, cp = num_stages, config.tensor_parallel, config.context_parallel
    if topology is None:
        dp = config.data_parallel
        if dp is None:
            if world_size % (pp * tp * cp):
                context = f" × context_parallel={cp}" if cp > 1 else ""
                raise PipelineConfigError(
                    f"world size {world_size} is not divisible by num_stages={pp}{context} × "
                    f"tensor_parallel={tp}; launch a multiple of {pp * cp * tp} ranks or "
                    f"change num_stages / tensor_parallel")
            dp = world_size // (pp * tp * cp)
        try:  # sizes are checked ints >= 1 (ParallelConfig); ep must divide dp · cp
            topology = Topology(pp, dp, tp, config.expert_parallel, cp)
        except TopologyError as error:
            raise PipelineConfigError(str(error)) from error
    else:
        asked = {"num_stages": (topology.pp, pp), "data_parallel": (topology.dp,
                                                                    config.data_parallel),
                 "tensor_parallel": (topology.tp, tp),
                 "expert_parallel": (topology.ep, config.expert_parallel),
                 "context_parallel": (topology.cp, cp)}
        clashes = [f"{name}={mine} but the topology has {theirs}"
                   for name, (theirs, mine) in asked.items()
                   if mine is not None and mine != theirs and not (
                       name in ("tensor_parallel", "expert_parallel", "context_parallel")
                       and mine == 1)]
        if clashes:
            raise PipelineConfigError(f"topology {topology} disagrees with the arguments: "
                                      f"{'; '.join(clashes)}; pass only one of them")
    try:
        check_world_size(topology, world_size)
    except TopologyError as error:
        raise PipelineConfigError(str(error)) from error
    return topology


def needs_process_groups(topology: Topology, config: ParallelConfig) -> bool:
    """Whether the run needs dp/tp groups (a pure pipeline talks over the world alone)."""
    return topology.world_size > topology.pp or config.zero_stage is not ZeroStage.DISABLED


@dataclass
class TrainingRuntime:
    """What `setup_training` built for one rank."""

    reducer: GradReducer
    """Called at REDUCE_GRAD (per stage) and waited at STEP."""
    optimizer: RankOptimizer | None
    """The torch optimizer, or the `ShardedOptimizer` under ZeRO-1 (None: nothing to step)."""
    tied: TiedWeightSynchronizer | None
    """Keeps tied copies identical (None without `TiedLayerSpec`s on this rank)."""
    scaler: DynamicLossScaler | None
    """fp16 loss scaler (None otherwise)."""
    step: OptimizerStep
    """What STEP runs after the reducer's wait."""

    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward (1 except under fp16)."""
        return 1.0 if self.scaler is None else self.scaler.scale


def setup_training(module: PipelineModule, placement: Sequence[int], topology: Topology,
                   groups: ProcessGroups | None, config: ParallelConfig,
                   optimizer: OptimizerFactory | torch.optim.Optimizer | None,
                   gradient_reducer: GradReducer | None = None,
                   link: LocalLink | None = None) -> TrainingRuntime:
    """Build this rank's reducer, optimizer and STEP for a materialized `module` (STEP's
    vote goes through `link`, the engine's datagram link over the world, when given)."""
    if config.half_parameters:  # Megatron's Float16Module: the stages hold half parameters
        module.to(half_dtype(config.precision))
    params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
    tp_rank = 0 if groups is None else groups.position.tp_rank
    # 1. Tied weights: a group per key over its owners' pipeline ranks (same dp, tp).
    tied = None
    owners = {key: [placement[stage] for stage in stages]
              for key, stages in module.tied_owner_stages().items()}
    if owners:
        tied = TiedWeightSynchronizer(module.tied_parameters(),
                                      create_tied_groups(topology, owners))
    # 2. One starting value: dp replicas copy dp rank 0, tied copies their primary owner.
    expert_dp_group = None if groups is None else groups.expert_dp_group
    if groups is not None and expert_dp_group is not None:
        broadcast_split(params, groups.dp_group, expert_dp_group)
    elif groups is not None:
        broadcast_parameters(params, groups.dp_group)
    if tied is not None:
        tied.broadcast_initial()
    # 3. Reducer and optimizer (ZeRO-1's sharded optimizer is both).
    view: GradientView
    built: RankOptimizer | None
    if config.zero_stage is not ZeroStage.DISABLED:
        zero = f"zero_stage={int(config.zero_stage)}"
        if gradient_reducer is not None:
            raise PipelineConfigError(f"{zero} reduces gradients itself (reduce-scatter "
                                      f"into shards); drop gradient_reducer=")
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            raise PipelineConfigError(
                f"{zero} builds its optimizer over this rank's shards: pass a factory "
                f"such as optimizer=lambda params: torch.optim.Adam(params, lr=1e-3), not "
                f"{type(optimizer).__name__}")
        if groups is None:
            raise PipelineConfigError(f"internal error: {zero} needs process groups")
        sharded = shard_stages(module, tied, optimizer, groups, config) if params else None
        reducer: GradReducer = sharded if sharded is not None else NoOpGradReducer()
        built = sharded
        view = ShardedGrads(sharded, groups.world_group, tp_rank)
    else:
        reducer = gradient_reducer or (
            make_grad_reducer(groups.dp_group, bucket_mb=config.bucket_mb)
            if groups is not None and topology.gradient_replicas > 1 else NoOpGradReducer())
        built = make_optimizer(optimizer, params)
        if config.overlap_grad_reduce and isinstance(reducer, BucketedGradReducer):
            _watch_stages(reducer, module, tied)
        if expert_dp_group is not None and gradient_reducer is None:
            reducer = ExpertSplitReducer(reducer, expert_dp_group, topology.ep,
                                         bucket_mb=config.bucket_mb)
        view = ReplicatedGrads(params, None if groups is None
                               else groups.model_parallel_group, tp_rank)
        if groups is not None and expert_dp_group is not None:
            replica = groups.position.dp_rank * topology.cp + groups.position.cp_rank
            view = ExpertReplicatedGrads(params, groups.world_group, dp_rank=replica,
                                         ep=topology.ep, tp_rank=tp_rank)
    if gradient_reducer is None:  # tp-partial gradients: summed once a step (ZeRO-0 / 1)
        reducer = defer_partial_sums(
            reducer, {int(s): module.stage_parameters(int(s)) for s in module.stages},
            zero_stage=int(config.zero_stage), tp=topology.tp,
            keep=[] if tied is None else tied.params)
    if tied is not None:
        reducer = TiedGradReducer(reducer, tied)
    # 4. Precision: fp16's overflow vote spans every rank.
    scaler = None
    if config.precision == "fp16":
        scaler = DynamicLossScaler(None if groups is None else groups.world_group,
                                   init_scale=config.initial_loss_scale,
                                   growth_interval=config.loss_scale_window)
    runtime = TrainingRuntime(reducer, built, tied, scaler, OptimizerStep(
        lambda: runtime.optimizer, view, scaler=scaler,
        max_grad_norm=config.gradient_clipping,
        finite_group=None if groups is None else groups.world_group, link=link))
    return runtime


def _watch_stages(reducer: BucketedGradReducer, module: PipelineModule,
                  tied: TiedWeightSynchronizer | None) -> None:
    """DDP's overlap: each stage's buckets launch from its last backward's gradient hooks
    (tied weights excepted: they are reduced at STEP, after their owners' sum)."""
    tied_ids = {id(p) for p in tied.params} if tied is not None else set()
    for stage in module.stages:  # expert shards are not the dp reducer's (ExpertSplitReducer)
        dense, _ = split_expert_parameters(module.stage_parameters(int(stage)))
        reducer.watch(int(stage), [p for p in dense if id(p) not in tied_ids])


def reduced_gradients(module: PipelineModule, optimizer: RankOptimizer | None
                      ) -> dict[tuple[int, str], torch.Tensor]:
    """(global layer index, parameter name) -> the gradient the last step used, after the
    dp reduction (and tied sum, clipping, unscaling). Under ZeRO-1 the shards are
    all-gathered: a collective over the dp group, for checks and debugging."""
    if isinstance(optimizer, ShardedOptimizer):
        gathered = optimizer.gather_grads()
        return {key: gathered[id(param)] for key, param in module.named_layer_parameters()
                if id(param) in gathered}
    return {key: param.grad.detach().clone() for key, param in module.named_layer_parameters()
            if param.grad is not None}


def optimizer_state_bytes(optimizer: RankOptimizer | None) -> int:
    """Bytes of this rank's optimizer-state tensors (moments, step counts)."""
    if optimizer is None:
        return 0
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.state_bytes()
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if isinstance(value, torch.Tensor))
