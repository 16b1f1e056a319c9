"""Marks on parameters that say how they are replicated across ranks (read by norms and sync)."""

from __future__ import annotations

import torch

__all__ = [
    "expert_shard",
    "is_tensor_parallel",
    "is_tied_duplicate",
    "mark_expert_shard",
    "mark_tensor_parallel",
    "mark_tied_duplicate",
    "tensor_parallel_dim",
]

# Attribute names set on the Parameter objects themselves (as Megatron's
# `tensor_model_parallel` flag): they travel with the parameter into any optimizer or reducer.
_TENSOR_PARALLEL = "pipesched_tensor_parallel_dim"
_TIED_DUPLICATE = "pipesched_tied_duplicate"
_EXPERT_SHARD = "pipesched_expert_shard"


def mark_tensor_parallel(param: torch.nn.Parameter, partition_dim: int) -> None:
    """Record that `param` is one tp rank's slice along `partition_dim` (not a replica)."""
    setattr(param, _TENSOR_PARALLEL, partition_dim)


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for a tensor-parallel slice; False for a parameter every tp rank holds whole
    (layer norms, a row-parallel layer's bias), whose gradients are identical across tp."""
    return getattr(param, _TENSOR_PARALLEL, None) is not None


def tensor_parallel_dim(param: torch.Tensor) -> int | None:
    """The dimension a tensor-parallel slice was cut along (None for a replicated tensor)."""
    dim = getattr(param, _TENSOR_PARALLEL, None)
    return None if dim is None else int(dim)


def mark_tied_duplicate(param: torch.nn.Parameter, duplicate: bool = True) -> None:
    """Record that `param` is a tied weight's copy on a non-primary owner stage."""
    setattr(param, _TIED_DUPLICATE, duplicate)


def is_tied_duplicate(param: torch.Tensor) -> bool:
    return bool(getattr(param, _TIED_DUPLICATE, False))


def mark_expert_shard(param: torch.nn.Parameter, first_expert: int, num_experts: int) -> None:
    """Record that `param` holds experts first_expert.. of num_experts along dim 0 (expert
    parallelism): its gradient is reduced over the expert-data-parallel group only."""
    setattr(param, _EXPERT_SHARD, (first_expert, num_experts))


def expert_shard(param: torch.Tensor) -> tuple[int, int] | None:
    """(first expert, experts in the whole layer) of an expert-parallel shard, else None."""
    shard = getattr(param, _EXPERT_SHARD, None)
    return None if shard is None else (int(shard[0]), int(shard[1]))
