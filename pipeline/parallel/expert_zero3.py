"""ZeRO-3 with expert parallelism: each layer's dense parameters sharded over dp, its expert
shards' parameters over their expert-data-parallel group, one torch optimizer stepping both.

Legend: d = dp size, ep = expert-parallel size (ep | d), d / ep = the expert-dp size (the
replicas holding the same experts). Rank r's experts differ from those of the other ranks of
its ep group, so they can only be sharded over the d / ep ranks holding the same ones (as
their gradients are only reduced there, `pipeline.parallel.expert_reduction`). Each layer is
then two units, one per half (`FullyShardedOptimizer` with a parameter filter):

    dense half    the layer's attention, norms, router ...   sharded / gathered over dp
    expert half   the layer's E / ep experts                 sharded / gathered over d / ep

Both halves hook the same layer: before its forward each gathers its own unit (dense first,
on every rank, so every group sees its collectives in one order), after it frees it, and
both follow `reshard_after_forward` alike. Each half gathers over its own second group
(`gather_group`, `expert_gather_group`), apart from the groups its gradients are reduced on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn
from torch.distributed import ProcessGroup

from pipeline.parallel.data_parallel import DEFAULT_BUCKET_MB
from pipeline.parallel.expert_zero import (
    ExpertGradShards,
    ExpertShardedOptimizer,
    placeholder_optimizer,
)
from pipeline.parallel.optimizer import OptimizerFactory
from pipeline.parallel.param_marks import expert_shard
from pipeline.parallel.zero3 import FullyShardedOptimizer

__all__ = ["ExpertFullyShardedOptimizer"]


class _ExpertFullShards(ExpertGradShards, FullyShardedOptimizer):
    """ZeRO-3 of a stage's expert shards over the expert-dp group: `ExpertGradShards`'
    bucket scaling (÷ ep, then the group's average over d / ep) on `FullyShardedOptimizer`
    (the method order puts the scaling first, then the ZeRO-3 units)."""


def _is_expert(param: nn.Parameter) -> bool:
    return expert_shard(param) is not None


def _is_dense(param: nn.Parameter) -> bool:
    return expert_shard(param) is None


class ExpertFullyShardedOptimizer(ExpertShardedOptimizer):
    """Two `FullyShardedOptimizer`s over the same layers, dense (over `dp_group`) and experts
    (over `expert_dp_group`), seen by the engine as one reducer and optimizer (as
    `ExpertShardedOptimizer`). `tied` parameters go to the dense half, unsharded."""

    def __init__(self, units_by_stage: Mapping[int, Sequence[nn.Module]],
                 optimizer_factory: OptimizerFactory, dp_group: ProcessGroup,
                 expert_dp_group: ProcessGroup, ep: int, *, gather_group: ProcessGroup,
                 expert_gather_group: ProcessGroup, tied: Sequence[nn.Parameter] = (),
                 reshard_after_forward: bool = True,
                 bucket_mb: float = DEFAULT_BUCKET_MB, prefetch_next_unit: bool = True) -> None:
        dense = FullyShardedOptimizer(
            units_by_stage, placeholder_optimizer, dp_group, gather_group=gather_group,
            tied=tied, reshard_after_forward=reshard_after_forward, bucket_mb=bucket_mb,
            select=_is_dense, prefetch_next_unit=prefetch_next_unit)
        has_experts = any(_is_expert(p) for layers in units_by_stage.values()
                          for layer in layers for p in layer.parameters())
        experts = _ExpertFullShards(
            units_by_stage, placeholder_optimizer, expert_dp_group, ep=ep,
            gather_group=expert_gather_group, reshard_after_forward=reshard_after_forward,
            bucket_mb=bucket_mb, select=_is_expert,
            prefetch_next_unit=prefetch_next_unit) if has_experts else None
        self.fully_sharded: list[FullyShardedOptimizer] = [
            half for half in (dense, experts) if half is not None]
        self.join(dense, experts, optimizer_factory)

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Take back what was written into exposed units, then step both halves."""
        for half in self.fully_sharded:
            half.take_back_writes()
        super().step(closure)

    def region_parameters(self) -> dict[int, list[nn.Parameter]]:
        """Unit key -> its dense parameters, then its experts' (what checkpoints describe:
        `pipeline.checkpoint.zero_state` splits each back into its halves)."""
        merged: dict[int, list[nn.Parameter]] = {}
        for half in self.fully_sharded:
            for key, params in half.region_parameters().items():
                merged.setdefault(key, []).extend(params)
        return dict(sorted(merged.items()))

    def gathered_units(self) -> frozenset[tuple[int, int]]:
        """(half: 0 dense, 1 experts, unit key) of the units gathered now."""
        return frozenset((index, key) for index, half in enumerate(self.fully_sharded)
                         for key in half.gathered_units())

    def unit_storage_bytes(self) -> int:
        """Bytes both halves' unit parameter buffers hold now (0 when none is gathered)."""
        return sum(half.unit_storage_bytes() for half in self.fully_sharded)

    @property
    def reshard_after_forward(self) -> bool:
        return self.fully_sharded[0].reshard_after_forward
