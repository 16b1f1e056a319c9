"""Tied weights across stages: one copy per owning stage, kept identical (same start value,
summed gradients)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.parallel.data_parallel import GradReducer, OverlappingReducer
from pipeline.parallel.param_marks import mark_tied_duplicate
from pipeline.parallel.topology import Topology, TopologyError

__all__ = [
    "TIED_REGION",
    "TiedGradReducer",
    "TiedGroup",
    "TiedWeightSynchronizer",
    "create_tied_groups",
    "split_tied",
]

TIED_REGION = -1
"""Region key (in place of a stage index) under which tied parameters are reduced over the
data-parallel group, after their owners' sum: give it to `ShardedOptimizer` via
`split_tied`."""


@dataclass(frozen=True)
class TiedGroup:
    """The ranks holding copies of one tied key that this rank syncs with."""

    ranks: tuple[int, ...]
    """Global ranks, ascending; ranks[0] is the primary (source of the initial value)."""
    group: ProcessGroup | None
    """None when the copies all live on this one rank (nothing to communicate)."""


def create_tied_groups(topology: Topology, owner_pp_ranks: Mapping[str, Iterable[int]]
                       ) -> dict[str, TiedGroup]:
    """Create a group per tied key and (dp, tp) coordinate over the pipeline ranks owning it.

    Collective (every rank, same arguments). Copies are synced between ranks with the same
    dp and tp coordinates: a vocab-parallel embedding's shard i is tied to shard i of the
    head. Returns this rank's group per key it owns.
    """
    rank = dist.get_rank()
    position = topology.position(rank)
    mine: dict[str, TiedGroup] = {}
    for key in sorted(owner_pp_ranks):
        owners = sorted(set(owner_pp_ranks[key]))
        if not owners or not all(0 <= k < topology.pp for k in owners):
            raise TopologyError(f"tied key {key!r}: owner pipeline ranks {owners} must be a "
                                f"non-empty subset of 0..{topology.pp - 1}")
        for d, c, t in itertools.product(range(topology.dp), range(topology.cp),
                                         range(topology.tp)):
            ranks = tuple(topology.rank_of(k, d, t, c) for k in owners)
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if (position.dp_rank, position.cp_rank, position.tp_rank) == (d, c, t) and \
                    position.pp_rank in owners:
                mine[key] = TiedGroup(ranks, group)
    return mine


class TiedWeightSynchronizer:
    """Keeps every copy of each tied weight identical across its owner ranks."""

    def __init__(self, tied_params: Mapping[str, Sequence[nn.Parameter]],
                 groups: Mapping[str, TiedGroup]) -> None:
        missing = sorted(set(tied_params) - set(groups))
        if missing:
            raise KeyError(f"no tied group for keys {missing}; create them with "
                           f"create_tied_groups for every key this rank owns")
        self.tied_params = {key: list(tied_params[key]) for key in sorted(tied_params)}
        self.groups = dict(groups)
        rank = dist.get_rank()
        for key, params in self.tied_params.items():
            for param in params:
                mark_tied_duplicate(param, rank != self.groups[key].ranks[0])

    @property
    def params(self) -> list[nn.Parameter]:
        """Every tied parameter on this rank, in a fixed order (keys sorted)."""
        return [param for params in self.tied_params.values() for param in params]

    def broadcast_initial(self) -> None:
        """Copy the primary owner's initial values to every copy (collective per group)."""
        for key, params in self.tied_params.items():
            tied = self.groups[key]
            if tied.group is not None:
                for param in params:
                    with torch.no_grad():
                        dist.broadcast(param.data, src=tied.ranks[0], group=tied.group)

    def all_reduce_grads(self) -> None:
        """Sum each tied weight's gradient over its copies (blocking). Call it at STEP, when
        every stage's backward is done: a stage can share a weight with a stage of the same
        rank, so no single REDUCE_GRAD is the point where its gradient is final."""
        works = []
        for key, params in self.tied_params.items():
            group = self.groups[key].group
            if group is None:
                continue
            for param in params:
                if param.grad is None:  # every copy must join the collective
                    param.grad = torch.zeros_like(param)
                work = dist.all_reduce(param.grad, group=group, async_op=True)
                if work is not None:
                    works.append(work)
        for work in works:
            work.wait()


def split_tied(params_by_stage: Mapping[int, Sequence[nn.Parameter]],
               tied: Iterable[nn.Parameter]) -> dict[int, list[nn.Parameter]]:
    """`params_by_stage` with tied parameters moved to their own `TIED_REGION` (the
    layout `ShardedOptimizer` needs with `TiedGradReducer`)."""
    tied_list = list(dict.fromkeys(tied))
    tied_ids = {id(p) for p in tied_list}
    regions = {stage: [p for p in params if id(p) not in tied_ids]
               for stage, params in params_by_stage.items()}
    regions[TIED_REGION] = tied_list
    return regions


class TiedGradReducer:
    """A `GradReducer` that sums tied gradients over their owners before the data-parallel
    reduction of them.

    Order matters for ZeRO-1: a reduce-scatter leaves each rank a shard laid out per stage,
    and the owners' stages lay the tied weight out differently, so the owners' sum must be
    taken on full gradients first. Untied parameters are reduced at their stage's
    REDUCE_GRAD as usual; tied ones at `wait` (STEP), after the sum.
    """

    def __init__(self, inner: GradReducer, tied: TiedWeightSynchronizer) -> None:
        self.inner, self.tied = inner, tied
        self._tied_ids = {id(p) for p in tied.params}

    def reduce_stage(self, stage_index: int, params: Sequence[nn.Parameter]) -> None:
        self.inner.reduce_stage(stage_index,
                                [p for p in params if id(p) not in self._tied_ids])

    def last_backward(self, stage_index: int) -> None:
        """Pass the overlap signal on (tied weights are reduced at `wait`, unhooked)."""
        if isinstance(self.inner, OverlappingReducer):
            self.inner.last_backward(stage_index)

    def backward_done(self, stage_index: int) -> None:
        """Pass ZeRO-2 / 3's end-of-backward signal on (`notify_backward_done`)."""
        hook = getattr(self.inner, "backward_done", None)
        if callable(hook):
            hook(stage_index)

    def wait(self) -> None:
        self.tied.all_reduce_grads()
        self.inner.reduce_stage(TIED_REGION, self.tied.params)
        self.inner.wait()
