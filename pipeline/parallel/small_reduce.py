"""All-reduce of a few numbers (a vote, a count) in two message hops on gloo.

Gloo's all_reduce runs a ring: a tensor of at least as many elements as ranks takes
2(p - 1) sequential hops, each of which must wake another process. With four ranks on two
cores that is what a step's vote costs most (measured here: 8 int64 take 5 ms, one element
0.7 ms). A gather to the group's first rank and a broadcast back take two hops whatever p
(0.9 ms for the same 8 int64), so small tensors go that way; NCCL, one element and two
ranks keep `all_reduce`, where it is already at its best. Ranks of one host with an
engine's `LocalLink` take the same two hops as datagrams.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pipeline.parallel.local_p2p import LocalLink, group_members

__all__ = ["small_all_reduce"]

_REDUCERS = {dist.ReduceOp.SUM: lambda stacked: stacked.sum(0),
             dist.ReduceOp.MAX: lambda stacked: stacked.amax(0)}
_LARGEST = 1024
"""Elements beyond which the ring's bandwidth matters more than its hops."""


def small_all_reduce(tensor: torch.Tensor, *, op: Any = dist.ReduceOp.SUM,
                     group: dist.ProcessGroup | None = None,
                     link: LocalLink | None = None) -> None:
    """`dist.all_reduce(tensor, op, group)` in place, for a small CPU tensor (SUM or MAX);
    through `link` (the engine's, `pipeline.parallel.local_p2p`) when it spans `group`."""
    size = dist.get_world_size(group)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    if op in _REDUCERS and size > 1 and link is not None and link.carries(tensor) and \
            link.spans(group):
        _over_link(tensor, op, group, root, link)
        return
    if (op not in _REDUCERS or size <= 2 or tensor.numel() <= 1 or tensor.numel() > _LARGEST
            or dist.get_backend(group) != "gloo" or tensor.device.type != "cpu"):
        dist.all_reduce(tensor, op=op, group=group)
        return
    mine = tensor.contiguous()
    gathered = [torch.empty_like(mine) for _ in range(size)] if dist.get_rank() == root \
        else None
    dist.gather(mine, gathered, dst=root, group=group)
    if gathered is not None:
        tensor.copy_(_REDUCERS[op](torch.stack(gathered)))
    dist.broadcast(tensor, root, group=group)


def _over_link(tensor: torch.Tensor, op: Any, group: dist.ProcessGroup | None, root: int,
               link: LocalLink) -> None:
    """The same gather and broadcast as datagrams: two hops of ~20 µs, not gloo's ~100."""
    mine = tensor.contiguous()
    if dist.get_rank() != root:
        link.send(mine, root).wait()
        link.recv(mine, root).wait()
        if mine is not tensor:
            tensor.copy_(mine)
        return
    others = [rank for rank in group_members(group) if rank != root]
    parts = [torch.empty_like(mine) for _ in others]
    for receive in [link.recv(part, rank) for part, rank in zip(parts, others)]:
        receive.wait()
    tensor.copy_(_REDUCERS[op](torch.stack([mine, *parts])))
    for send in [link.send(tensor.contiguous(), rank) for rank in others]:
        send.wait()
