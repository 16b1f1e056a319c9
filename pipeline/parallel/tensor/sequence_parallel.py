"""Megatron's sequence-parallel operators and the gradient sum of parameters tp ranks share.

Korthikanti et al., 2022 ("Reducing Activation Recomputation in Large Transformer Models",
§4.2.2): outside the tensor-parallel regions (norms, dropouts, residuals) each tp rank holds
1/t of the sequence. Entering a column-parallel region all-gathers the sequence (its
backward reduce-scatters the gradient); leaving a row-parallel region reduce-scatters the
partial sums (its backward all-gathers), the conjugate pair that replaces f / g:

    enter: g-bar = all-gather(seq)       backward: reduce-scatter(seq)
    exit:  g     = reduce-scatter(seq)   backward: all-gather(seq)

The sequence is dimension 1 here (HF's ``(batch, seq, hidden)``; Megatron's is 0).
A parameter every tp rank holds whole but whose gradient each rank computes from only its
part of the data (a norm over 1/t of the sequence, a per-head norm over 1/t of the heads)
gets its gradient summed over tp by `sum_gradient_over_tensor_parallel`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.tensor.collectives import tp_rank_and_size

__all__ = [
    "SEQUENCE_DIM",
    "gather_sequence",
    "reduce_scatter_sequence",
    "scatter_sequence",
    "sum_gradient_over_tensor_parallel",
]

SEQUENCE_DIM = 1
_SUMMED = "pipesched_tp_summed_gradient"


def _check_length(length: int, size: int) -> None:
    if length % size:
        raise ValueError(f"sequence parallelism splits the sequence over tp = {size} ranks, "
                         f"but the sequence has {length} tokens; pad the batch to a multiple "
                         f"of {size} tokens or turn sequence parallelism off")


def _all_gather(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    _, size = tp_rank_and_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=SEQUENCE_DIM)


def _reduce_scatter(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    _, size = tp_rank_and_size(group)
    if size == 1:
        return tensor
    _check_length(tensor.shape[SEQUENCE_DIM], size)
    inputs = [part.contiguous() for part in tensor.chunk(size, dim=SEQUENCE_DIM)]
    out = torch.empty_like(inputs[0])
    dist.reduce_scatter(out, inputs, group=group)
    return out


def _mine(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    rank, size = tp_rank_and_size(group)
    if size == 1:
        return tensor
    _check_length(tensor.shape[SEQUENCE_DIM], size)
    return tensor.chunk(size, dim=SEQUENCE_DIM)[rank].contiguous()


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _all_gather(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return _mine(tensor, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group), None


def gather_sequence(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Enter a column-parallel region: all-gather the sequence (reduce-scatter backward)."""
    out: torch.Tensor = _GatherSequence.apply(tensor, group)
    return out


def reduce_scatter_sequence(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Leave a row-parallel region: sum the partial outputs, keep this rank's part of the
    sequence (all-gather backward)."""
    out: torch.Tensor = _ReduceScatterSequence.apply(tensor, group)
    return out


def scatter_sequence(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Keep this rank's part of a replicated sequence (all-gather backward)."""
    out: torch.Tensor = _ScatterSequence.apply(tensor, group)
    return out


def sum_gradient_over_tensor_parallel(param: torch.Tensor, group: ProcessGroup | None) -> None:
    """Sum `param`'s gradient over the tp group each time autograd computes it (once per
    backward, also in a split backward's W and under recomputation), so every tp rank holds
    the whole parameter's whole gradient; a tensor hook, as the parameter is read inside
    modules we do not own. Megatron sums such gradients once per step instead
    (`allreduce_sequence_parallel_grads`); per backward costs m small all-reduces but needs
    no change to the reducer, and every tp rank runs the same graph in the same order."""
    if tp_rank_and_size(group)[1] == 1 or getattr(param, _SUMMED, False):
        return

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    param.register_hook(all_reduce)
    setattr(param, _SUMMED, True)
