"""Gradient reduction with expert parallelism: dense gradients over dp, expert shards over
their expert-data-parallel group only."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from pipeline.parallel.data_parallel import (
    BucketedGradReducer,
    GradReducer,
    OverlappingReducer,
    broadcast_parameters,
)
from pipeline.parallel.param_marks import expert_shard

__all__ = ["ExpertSplitReducer", "broadcast_split", "split_expert_parameters"]


def split_expert_parameters(params: Sequence[torch.nn.Parameter]
                            ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(dense parameters, expert-parallel shards) of `params`, order kept."""
    dense = [p for p in params if expert_shard(p) is None]
    return dense, [p for p in params if expert_shard(p) is not None]


def broadcast_split(params: Sequence[torch.nn.Parameter], dp_group: ProcessGroup,
                    expert_dp_group: ProcessGroup) -> None:
    """Replicas start from one value: dense parameters from dp rank 0, each expert shard
    from the first rank holding the same experts (ep ranks hold different ones)."""
    dense, experts = split_expert_parameters(params)
    broadcast_parameters(dense, dp_group)
    broadcast_parameters(experts, expert_dp_group)


class ExpertSplitReducer:
    """Dense gradients through `dense` (averaged over dp), expert shards averaged over the
    expert-data-parallel group (dp / ep ranks) and divided by ep.

    Why ep: an expert's gradient on one rank already sums the tokens of the ep replicas that
    dispatched to it (the combine's all-to-all backward brings them), each replica's loss
    being its own mean; the whole batch's gradient is the mean over all dp replicas, i.e.
    the sum over the dp / ep holders divided by dp."""

    def __init__(self, dense: GradReducer, expert_dp_group: ProcessGroup, ep: int, *,
                 bucket_mb: float) -> None:
        self.dense = dense
        self.experts = BucketedGradReducer(expert_dp_group, bucket_mb=bucket_mb)
        self.ep = ep

    def last_backward(self, stage_index: int) -> None:
        if isinstance(self.dense, OverlappingReducer):
            self.dense.last_backward(stage_index)

    def reduce_stage(self, stage_index: int, params: Sequence[torch.nn.Parameter]) -> None:
        dense, experts = split_expert_parameters(params)
        self.dense.reduce_stage(stage_index, dense)
        for param in experts:
            if param.grad is not None:
                param.grad.div_(self.ep)
        self.experts.reduce_stage(stage_index, experts)

    def wait(self) -> None:
        self.dense.wait()
        self.experts.wait()
