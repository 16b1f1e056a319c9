"""Tensor-parallel communication operators (Megatron's conjugate f / g pairs) as autograd functions.

Shoeybi et al., 2019 (Megatron-LM, §3): a column-parallel layer needs its input replicated
on every tp rank, a row-parallel layer sums its partial outputs. The conjugate pair:

    f = copy_to_tensor_parallel_region      forward: identity     backward: all-reduce
    g = reduce_from_tensor_parallel_region  forward: all-reduce   backward: identity

so an MLP  Y = g(GeLU(f(X) A_i) B_i)  costs one all-reduce forward and one backward.
scatter/gather move between a replicated tensor and its tp slices along the last dim.

Why our own autograd functions and not `torch.distributed.tensor.parallel`
(`parallelize_module` with ColwiseParallel/RowwiseParallel), checked on torch 2.13 + gloo:
- parameters become DTensors, and so do their gradients. Everything downstream here works on
  plain tensors: the bucketed DP reducer and ZeRO-1 flatten gradients into flat buffers
  (`torch.cat` of DTensor gradients silently all-gathers them to full size, so a flat
  buffer would hold the unsharded tensor), ZeRO re-points `param.data` into its buffer, and
  tied-weight sync broadcasts `param.data`; each would need a DTensor path.
- module outputs are `AsyncCollectiveTensor`s (a tensor subclass with a pending collective);
  a hand-driven pipeline sends activations with P2P ops, which need a plain, completed
  tensor, so every stage boundary would need explicit waits/unwrapping.
- loading a shard from a full-size layer, and tying the vocab-parallel embedding to the
  output head on another stage, are one slice each with plain tensors.
Plain autograd functions keep every tensor the pipeline sees an ordinary tensor, at the
cost of ~100 lines. With tp = 1 every operator is the identity and communicates nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "copy_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region",
    "split_last_dim",
    "tp_rank_and_size",
]


def tp_rank_and_size(group: ProcessGroup | None) -> tuple[int, int]:
    """This rank's index in the tp group and the group's size; (0, 1) without a group.

    None means "no tensor parallelism", never torch's default group: a layer built outside
    an engine (the single-process reference, parameter counting for the partition) is then
    the full layer even inside a multi-rank job.
    """
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def split_last_dim(tensor: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """The `index`-th of `parts` equal slices along the last dimension (contiguous copy)."""
    size = tensor.shape[-1]
    if size % parts:
        raise ValueError(f"last dimension {size} is not divisible by the tensor-parallel "
                         f"size {parts}; choose sizes divisible by tp")
    width = size // parts
    return tensor[..., index * width:(index + 1) * width].contiguous()


def _all_reduce(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    if tp_rank_and_size(group)[1] == 1:
        return tensor
    out = tensor.contiguous().clone()  # autograd inputs must not change in place
    dist.all_reduce(out, group=group)
    return out


def _gather_last_dim(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    _, size = tp_rank_and_size(group)
    if size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=-1)


def _split_mine(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    rank, size = tp_rank_and_size(group)
    return tensor if size == 1 else split_last_dim(tensor, size, rank)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        return _all_reduce(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _split_mine(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _gather_last_dim(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_mine(grad, ctx.group), None


def copy_to_tensor_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None
                                   ) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward (input of a column layer)."""
    out: torch.Tensor = _CopyToRegion.apply(tensor, group)
    return out


def reduce_from_tensor_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None
                                       ) -> torch.Tensor:
    """g: all-reduce forward, identity backward (output of a row layer)."""
    out: torch.Tensor = _ReduceFromRegion.apply(tensor, group)
    return out


def scatter_to_tensor_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None
                                      ) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    out: torch.Tensor = _ScatterToRegion.apply(tensor, group)
    return out


def gather_from_tensor_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None
                                       ) -> torch.Tensor:
    """All-gather slices along the last dim forward; keep this rank's slice backward."""
    out: torch.Tensor = _GatherFromRegion.apply(tensor, group)
    return out
