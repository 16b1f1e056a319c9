"""A pipeline rank's stages in their ZeRO-sharded form: the optimizer for zero_stage 1, 2 or 3.

One region per stage (ZeRO-1, 2), or per layer of a stage (ZeRO-3's units); tied weights in
their own region, reduced after their owners' sum (`pipeline.parallel.tied_sync`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from pipeline.model.module import PipelineModule
from pipeline.parallel.config import ParallelConfig, ZeroStage
from pipeline.parallel.expert_zero import ExpertShardedOptimizer
from pipeline.parallel.expert_zero3 import ExpertFullyShardedOptimizer
from pipeline.parallel.groups import (
    ProcessGroups,
    create_expert_gather_group,
    create_gather_group,
)
from pipeline.parallel.optimizer import OptimizerFactory
from pipeline.parallel.tied_sync import TiedWeightSynchronizer, split_tied
from pipeline.parallel.zero import ShardedOptimizer
from pipeline.parallel.zero2 import GradShardedOptimizer
from pipeline.parallel.zero3 import FullyShardedOptimizer

__all__ = ["checkpoint_regions", "shard_stages", "zero_regions"]


def shard_stages(module: PipelineModule, tied: TiedWeightSynchronizer | None,
                 factory: OptimizerFactory, groups: ProcessGroups,
                 config: ParallelConfig) -> ShardedOptimizer:
    """This rank's stages sharded over the dp group at `config.zero_stage` (1, 2 or 3): the
    optimizer that is also their gradient reducer (collective: every rank calls it)."""
    def inner(params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        # the factory gets this rank's model parameters; its groups are carried onto shards
        return factory(cast(list[nn.Parameter], params))

    sharded: ShardedOptimizer
    stage = config.zero_stage
    if stage is ZeroStage.PARAMETERS and groups.expert_dp_group is not None:
        # dense units over dp, expert units over the expert-dp group (gather groups first,
        # in one order on every rank: creating a group is collective)
        gather_group = create_gather_group(groups)
        sharded = ExpertFullyShardedOptimizer(
            _stage_layers(module), inner, groups.dp_group, groups.expert_dp_group,
            groups.topology.ep, gather_group=gather_group,
            expert_gather_group=create_expert_gather_group(groups),
            tied=[] if tied is None else tied.params,
            reshard_after_forward=config.reshard_after_forward, bucket_mb=config.bucket_mb,
            prefetch_next_unit=config.prefetch_next_unit)
    elif stage is ZeroStage.PARAMETERS:
        sharded = FullyShardedOptimizer(
            _stage_layers(module), inner, groups.dp_group,
            gather_group=create_gather_group(groups),
            tied=[] if tied is None else tied.params,
            reshard_after_forward=config.reshard_after_forward, bucket_mb=config.bucket_mb,
            prefetch_next_unit=config.prefetch_next_unit)
    elif groups.expert_dp_group is not None:  # expert states over their own group
        sharded = ExpertShardedOptimizer(zero_regions(module, tied), inner, groups.dp_group,
                                         groups.expert_dp_group, groups.topology.ep,
                                         bucket_mb=config.bucket_mb,
                                         overlap_param_gather=config.overlap_param_gather,
                                         zero_stage=int(stage))
    elif stage is ZeroStage.GRADIENTS:
        sharded = GradShardedOptimizer(zero_regions(module, tied), inner, groups.dp_group,
                                       bucket_mb=config.bucket_mb,
                                       overlap_param_gather=config.overlap_param_gather)
    else:
        sharded = ShardedOptimizer(zero_regions(module, tied), inner, groups.dp_group,
                                   bucket_mb=config.bucket_mb,
                                   overlap_param_gather=config.overlap_param_gather)
    layers_held = [layer for key in module.stages
                   for layer in module.stage(int(key)).layers.values()]
    if config.overlap_param_gather:  # each layer's forward waits for its own buckets
        sharded.watch_forward(layers_held)
    if config.overlap_param_gather or stage is ZeroStage.PARAMETERS:
        # `state_dict` (checkpoints, exports) completes the gathers (ZeRO-3: gathers every
        # layer; the next forward or step frees them again)
        for layer in [module, *layers_held]:
            layer.register_state_dict_pre_hook(lambda *_: sharded.finish_param_gather())
    return sharded


def _stage_layers(module: PipelineModule) -> dict[int, list[nn.Module]]:
    """Stage -> its layers, in order (ZeRO-3's units)."""
    return {int(key): list(module.stage(int(key)).layers.values()) for key in module.stages}


def checkpoint_regions(module: PipelineModule, tied: TiedWeightSynchronizer | None,
                       optimizer: object) -> dict[int, list[nn.Parameter]] | None:
    """The regions a checkpoint describes `optimizer` by (None: not a ZeRO optimizer):
    ZeRO-3's per-layer units as it built them (with ep: each unit's dense parameters, then
    its experts'), else one per stage (`zero_regions`)."""
    if isinstance(optimizer, FullyShardedOptimizer | ExpertFullyShardedOptimizer):
        return optimizer.region_parameters()
    if isinstance(optimizer, ShardedOptimizer):
        return zero_regions(module, tied)
    return None


def zero_regions(module: PipelineModule, tied: TiedWeightSynchronizer | None
                 ) -> dict[int, list[nn.Parameter]]:
    """The parameters of each ZeRO-1 / 2 region: one per stage, tied weights in
    `TIED_REGION` (the layout checkpoints must describe, too)."""
    by_stage: dict[int, list[nn.Parameter]] = {
        int(stage): module.stage_parameters(int(stage)) for stage in module.stages}
    return split_tied(by_stage, tied.params) if tied is not None else by_stage
