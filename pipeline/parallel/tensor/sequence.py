"""Sequence-parallel communication (Korthikanti et al. 2022, section 4.2.2) as autograd functions.

With sequence parallelism the layer norms, dropouts and residuals of a tensor-parallel block
hold 1/t of the sequence on each of t ranks. The block's tensor-parallel regions still need
the whole sequence, so Megatron's conjugate pair f / g (`collectives`) becomes:

    g = gather_from_sequence_parallel_region        fwd: all-gather      bwd: reduce-scatter
    ḡ = reduce_scatter_to_sequence_parallel_region  fwd: reduce-scatter  bwd: all-gather

    x_i ─ LN ─ g ─▶ column-parallel ─ ... ─ row-parallel ─▶ ḡ ─ + ─▶ y_i    (i: this rank's slice)

An all-reduce is a reduce-scatter then an all-gather, so the bytes on the wire are those of
tensor parallelism alone. `scatter_to_sequence_parallel_region` enters the sequence-parallel
part (keep my slice; backward all-gather) and `gather_from_sequence_parallel_region(...,
reduce_grads=False)` leaves it for a consumer that is replicated (backward: keep my slice).
Parameters used on the slices (the norms' weights, a row-parallel layer's bias) get only this
slice's gradient: `reduce_grad_over_tensor_parallel` all-reduces it in the backward where we
write the forward, `sum_gradient_over_tensor_parallel` (a tensor hook) where the parameter is
read inside a module we do not own (a HF model's norms).

The sequence dimension is an argument (`SEQUENCE_DIM`, 1 for the engine's (batch, seq,
hidden) layers; Megatron's (seq, batch, hidden) uses 0). `start_all_gather` /
`start_reduce_scatter` / `start_all_reduce` launch the same collectives with
``async_op=True`` and return a `PendingCollective`; the overlapped linear layers
(`overlap`) compute while they run. With no group (tp = 1) every function is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from pipeline.parallel.flat_collectives import all_gather_flat, reduce_scatter_flat
from pipeline.parallel.tensor.collectives import (
    copy_to_tensor_parallel_region,
    tp_rank_and_size,
)
from pipeline.parallel.tensor.partial_grads import mark_partial_gradient

__all__ = [
    "SEQUENCE_DIM",
    "GatherSequence",
    "PendingCollective",
    "ScatterSequence",
    "gather_from_sequence_parallel_region",
    "reduce_grad_over_tensor_parallel",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "split_sequence",
    "start_all_gather",
    "start_all_reduce",
    "start_reduce_scatter",
    "sum_gradient_over_tensor_parallel",
]

SEQUENCE_DIM = 1
"""The sequence dimension of the engine's activations, (batch, seq, hidden)."""
_SUMMED = "pipesched_tp_summed_gradient"


def split_sequence(tensor: torch.Tensor, parts: int, index: int, dim: int = SEQUENCE_DIM
                   ) -> torch.Tensor:
    """The `index`-th of `parts` equal slices along `dim` (a contiguous copy)."""
    size = tensor.shape[dim]
    if size % parts:
        raise ValueError(f"sequence length {size} (dim {dim}) is not divisible by the "
                         f"tensor-parallel size {parts}; with sequence parallelism choose a "
                         f"sequence length that is a multiple of tp")
    return tensor.narrow(dim, index * (size // parts), size // parts).contiguous()


class PendingCollective:
    """A launched collective: `wait()` blocks until it is done and returns its result.

    `finish` maps the raw output buffer to the result (moving the sequence dim back), so a
    caller never sees the dim-0 layout torch's collectives work in."""

    def __init__(self, work: Any, buffer: torch.Tensor, dim: int) -> None:
        self._work, self._buffer, self._dim = work, buffer, dim

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._buffer.movedim(0, self._dim)


def _front(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """`tensor` with `dim` moved first, contiguous: torch's *_tensor collectives concatenate
    and split along dim 0."""
    return tensor.movedim(dim, 0).contiguous()


def start_all_gather(tensor: torch.Tensor, group: ProcessGroup | None, dim: int = SEQUENCE_DIM,
                     *, async_op: bool = True) -> PendingCollective:
    """Launch the all-gather of every rank's slice along `dim` (rank order)."""
    _, size = tp_rank_and_size(group)
    if size == 1:
        return PendingCollective(None, _front(tensor, dim), dim)
    local = _front(tensor, dim)
    out = local.new_empty((local.shape[0] * size, *local.shape[1:]))
    work = all_gather_flat(out, local, group=group, async_op=async_op)
    return PendingCollective(work, out, dim)


def start_reduce_scatter(tensor: torch.Tensor, group: ProcessGroup | None,
                         dim: int = SEQUENCE_DIM, *, async_op: bool = True
                         ) -> PendingCollective:
    """Launch the sum over ranks of `tensor`, each rank keeping its slice along `dim`."""
    _, size = tp_rank_and_size(group)
    if size == 1:
        return PendingCollective(None, _front(tensor, dim), dim)
    if tensor.shape[dim] % size:
        split_sequence(tensor, size, 0, dim)  # raises the typed error
    full = _front(tensor, dim)
    out = full.new_empty((full.shape[0] // size, *full.shape[1:]))
    work = reduce_scatter_flat(out, full, group=group, async_op=async_op)
    return PendingCollective(work, out, dim)


def start_all_reduce(tensor: torch.Tensor, group: ProcessGroup | None, *,
                     async_op: bool = True) -> PendingCollective:
    """Launch the sum over ranks of `tensor` (into a copy: autograd inputs stay unchanged)."""
    out = tensor.contiguous().clone()
    _, size = tp_rank_and_size(group)
    work = None if size == 1 else dist.all_reduce(out, group=group, async_op=async_op)
    return PendingCollective(work, out, 0)


def _my_slice(tensor: torch.Tensor, group: ProcessGroup | None, dim: int) -> torch.Tensor:
    rank, size = tp_rank_and_size(group)
    return tensor if size == 1 else split_sequence(tensor, size, rank, dim)


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None, dim: int
                ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _my_slice(tensor, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return start_all_gather(grad, ctx.group, ctx.dim, async_op=False).wait(), None, None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None, dim: int,
                reduce_grads: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.reduce_grads = group, dim, reduce_grads
        return start_all_gather(tensor, group, dim, async_op=False).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.reduce_grads:
            out = start_reduce_scatter(grad, ctx.group, ctx.dim, async_op=False).wait()
        else:
            out = _my_slice(grad, ctx.group, ctx.dim)
        return out, None, None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup | None, dim: int
                ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return start_reduce_scatter(tensor, group, dim, async_op=False).wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return start_all_gather(grad, ctx.group, ctx.dim, async_op=False).wait(), None, None


def scatter_to_sequence_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None,
                                        dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Enter the sequence-parallel part: keep my slice of a replicated tensor along `dim`;
    backward all-gathers the slices' gradients."""
    out: torch.Tensor = _ScatterSequence.apply(tensor, group, dim)
    return out


def gather_from_sequence_parallel_region(tensor: torch.Tensor, group: ProcessGroup | None,
                                         dim: int = SEQUENCE_DIM, *,
                                         reduce_grads: bool = True) -> torch.Tensor:
    """All-gather the slices along `dim`. Before a column-parallel region (`reduce_grads`)
    each rank's gradient is a partial sum, so the backward reduce-scatters it; leaving the
    sequence-parallel part for a replicated consumer (``reduce_grads=False``) every rank holds
    the whole gradient, so the backward keeps its slice."""
    out: torch.Tensor = _GatherSequence.apply(tensor, group, dim, reduce_grads)
    return out


def reduce_scatter_to_sequence_parallel_region(tensor: torch.Tensor,
                                               group: ProcessGroup | None,
                                               dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """After a row-parallel region: sum the partial outputs, keep my slice along `dim`;
    backward all-gathers the gradient."""
    out: torch.Tensor = _ReduceScatterSequence.apply(tensor, group, dim)
    return out


def reduce_grad_over_tensor_parallel(parameter: torch.Tensor, group: ProcessGroup | None
                                     ) -> torch.Tensor:
    """`parameter` as used on a sequence slice: identity forward, its gradient all-reduced
    over tp backward, so the replicated weight of a norm (or a row layer's bias) gets the
    whole sequence's gradient on every tp rank (Megatron reduces these once a step instead;
    per backward keeps them exact under any schedule, split backward and ZeRO included)."""
    return copy_to_tensor_parallel_region(parameter, group)


def sum_gradient_over_tensor_parallel(param: torch.Tensor, group: ProcessGroup | None) -> None:
    """Sum `param`'s gradient over the tp group each time autograd computes it (once per
    backward, also in a split backward's W and under recomputation), so every tp rank holds
    the whole parameter's whole gradient. `reduce_grad_over_tensor_parallel` as a tensor
    hook, for a parameter read inside a module we do not own (a HF model's norms, a per-head
    norm over 1/t of the heads); registering it twice on one parameter is a no-op. The
    parameter is marked (`partial_grads`) so that an engine may remove the hook and sum the
    accumulated gradient once a step instead."""
    if tp_rank_and_size(group)[1] == 1 or getattr(param, _SUMMED, False):
        return

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        return start_all_reduce(grad, group, async_op=False).wait()

    mark_partial_gradient(param, group, all_reduce)  # registers it unless an engine defers
    setattr(param, _SUMMED, True)


class ScatterSequence(nn.Module):
    """A layer entering the sequence-parallel blocks: keeps this tp rank's sequence slice
    (`scatter_to_sequence_parallel_region`); the engine fills `group` at build time."""

    def __init__(self, group: ProcessGroup | None = None, dim: int = SEQUENCE_DIM) -> None:
        super().__init__()
        self.group, self.dim = group, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_to_sequence_parallel_region(x, self.group, self.dim)


class GatherSequence(nn.Module):
    """A layer leaving the sequence-parallel blocks for replicated ones (a head, a loss):
    all-gathers the slices, backward keeps this rank's slice of the gradient."""

    def __init__(self, group: ProcessGroup | None = None, dim: int = SEQUENCE_DIM) -> None:
        super().__init__()
        self.group, self.dim = group, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_sequence_parallel_region(x, self.group, self.dim,
                                                    reduce_grads=False)
