"""Tensor-parallel linear layers whose collectives run beside their GEMMs (Megatron-Core's
``--tp-comm-overlap``), with or without sequence parallelism.

Each collective is launched with ``async_op=True`` and waited on only when its result is
needed; the GEMMs that do not need it run meanwhile. What runs beside what (t: tp size, c:
`chunks`; the pure rule that prices it is `schedules.analysis.tp_overlap`):

    column-parallel  Y = X Aᵢ
      forward  (sequence parallel) all-gather X in c column slices: GEMM of slice k runs
               while slice k+1 arrives                         (pipelined, gather first)
      backward (sequence parallel) all-gather X again   ∥ dX = dY Aᵢ       (input gradient)
               all-reduce / reduce-scatter dX           ∥ dAᵢ = dYᵀ X     (weight gradient)
    row-parallel     Y = Σᵢ Xᵢ Bᵢ
      forward  c column slices of the output: the all-reduce / reduce-scatter of slice k
               runs while slice k+1's GEMM does                 (pipelined, GEMM first)
      backward (sequence parallel) all-gather dY in c slices, dX accumulated slice by slice

Under sequence parallelism the column layer keeps only its sequence slice of X for the
backward and gathers it again there (Korthikanti et al. 2022, section 4.2.2), so its saved
input is 1/t of the sequence. With ``overlap=False`` the same functions wait on every
collective as soon as it is launched: the sequential baseline, same arithmetic order.

`TensorParallelOps` is the seam for the GEMMs and collective launches: `REAL_OPS` runs them
(torch.matmul, torch.distributed); `pipeline.rehearsal.emulated_tp` makes them timed waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from itertools import pairwise
from typing import Any, Protocol

import torch
from torch.distributed import ProcessGroup

from pipeline.parallel.tensor.collectives import tp_rank_and_size
from pipeline.parallel.tensor.sequence import (
    SEQUENCE_DIM,
    reduce_grad_over_tensor_parallel,
    start_all_gather,
    start_all_reduce,
    start_reduce_scatter,
)

__all__ = ["REAL_OPS", "Collective", "Gemm", "Pending", "TensorParallelOps",
           "column_parallel_linear", "reduce_grad", "row_parallel_linear"]


class Collective(Enum):
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"


class Gemm(Enum):
    FORWARD = "forward"
    INPUT_GRAD = "input_grad"
    WEIGHT_GRAD = "weight_grad"


class Pending(Protocol):
    def wait(self) -> torch.Tensor:
        """Block until the collective is done; its result."""


class TensorParallelOps(Protocol):
    """The GEMMs and collective launches of the overlapped linear layers."""

    def matmul(self, a: torch.Tensor, b: torch.Tensor, gemm: Gemm) -> torch.Tensor:
        """a @ b; `gemm` says which of the linear layer's three GEMMs it is."""

    def start(self, collective: Collective, tensor: torch.Tensor, group: ProcessGroup | None,
              dim: int) -> Pending:
        """Launch `collective` over `group` (along `dim` for gather/scatter), async."""


class _RealOps:
    """torch.matmul and torch.distributed's async collectives."""

    def matmul(self, a: torch.Tensor, b: torch.Tensor, gemm: Gemm) -> torch.Tensor:
        return torch.matmul(a, b)

    def start(self, collective: Collective, tensor: torch.Tensor, group: ProcessGroup | None,
              dim: int) -> Pending:
        if collective is Collective.ALL_GATHER:
            return start_all_gather(tensor, group, dim)
        if collective is Collective.REDUCE_SCATTER:
            return start_reduce_scatter(tensor, group, dim)
        return start_all_reduce(tensor, group)


REAL_OPS: TensorParallelOps = _RealOps()


def _launch(ops: TensorParallelOps, overlap: bool, collective: Collective,
            tensor: torch.Tensor, group: ProcessGroup | None, dim: int) -> Pending:
    """Launch; without overlap wait at once (the sequential baseline)."""
    pending = ops.start(collective, tensor, group, dim)
    return pending if overlap else _Done(pending.wait())


class _Done:
    """A collective already waited on."""

    def __init__(self, result: torch.Tensor) -> None:
        self._result = result

    def wait(self) -> torch.Tensor:
        return self._result


def _slices(size: int, chunks: int) -> list[slice]:
    """`chunks` near-equal contiguous slices of range(size) (fewer when size is smaller)."""
    bounds = [round(k * size / chunks) for k in range(chunks + 1)]
    return [slice(a, b) for a, b in pairwise(bounds) if b > a]


def _gathered_matmul(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup | None,
                     dim: int, chunks: int, overlap: bool, ops: TensorParallelOps,
                     gemm: Gemm) -> tuple[torch.Tensor, torch.Tensor]:
    """(gather(x) @ weight, gather(x)), gathering x along `dim` in `chunks` slices of its
    last dim, each slice's GEMM (x[..., k] @ weight[k, :]) while the next arrives."""
    parts = _slices(x.shape[-1], chunks if overlap else 1)
    pending = [_launch(ops, overlap, Collective.ALL_GATHER, x[..., part], group, dim)
               for part in parts]
    out: torch.Tensor | None = None
    gathered = []
    for part, handle in zip(parts, pending, strict=True):
        piece = handle.wait()
        gathered.append(piece)
        product = ops.matmul(piece, weight[part], gemm)
        out = product if out is None else out + product
    assert out is not None
    return out, torch.cat(gathered, dim=-1)


def _keep_autocast(ctx: Any, x: torch.Tensor) -> None:
    """Note the forward's autocast (device type, dtype or None) on `ctx`: autograd runs a
    Function's backward outside it, where a bf16/fp16 gradient would meet an fp32 weight
    (``Half != float``) in the GEMMs (as `torch.amp.custom_bwd`, for any device type)."""
    device_type = x.device.type
    ctx.autocast = device_type, torch.get_autocast_dtype(device_type) \
        if torch.is_autocast_enabled(device_type) else None


def _forward_autocast(ctx: Any) -> torch.autocast:
    """The forward's autocast around a backward (`_keep_autocast`)."""
    device_type, dtype = ctx.autocast
    return torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)


class _ColumnLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup | None,
                sequence_parallel: bool, overlap: bool, chunks: int, dim: int,
                ops: TensorParallelOps, *parts: torch.Tensor) -> torch.Tensor:
        _keep_autocast(ctx, x)
        # x: the sequence slice under sequence parallelism; the weight's row blocks `parts`
        # are saved, not their concatenation (a copy of the weight per microbatch)
        ctx.save_for_backward(x, *parts)
        ctx.settings = group, sequence_parallel, overlap, dim, ops
        weight = _joined(parts)
        if not sequence_parallel:
            return ops.matmul(x, weight.t(), Gemm.FORWARD)
        out, _ = _gathered_matmul(x, weight.t(), group, dim, chunks, overlap, ops,
                                  Gemm.FORWARD)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with _forward_autocast(ctx):
            return _ColumnLinear.gradients(ctx, grad)

    @staticmethod
    def gradients(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *parts = ctx.saved_tensors
        group, sequence_parallel, overlap, dim, ops = ctx.settings
        gather = _launch(ops, overlap, Collective.ALL_GATHER, x, group, dim) \
            if sequence_parallel else None
        grad_input = ops.matmul(grad, _joined(parts), Gemm.INPUT_GRAD)   # ∥ the gather
        x_full = gather.wait() if gather is not None else x
        reduce = _launch(ops, overlap, Collective.REDUCE_SCATTER if sequence_parallel
                         else Collective.ALL_REDUCE, grad_input, group, dim)
        grad_weight = ops.matmul(grad.reshape(-1, grad.shape[-1]).t(),   # ∥ the reduction
                                 x_full.reshape(-1, x_full.shape[-1]), Gemm.WEIGHT_GRAD)
        grad_parts = grad_weight.split([part.shape[0] for part in parts])
        return reduce.wait(), None, None, None, None, None, None, *grad_parts


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


class _RowLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup | None,
                sequence_parallel: bool, overlap: bool, chunks: int, dim: int,
                ops: TensorParallelOps) -> torch.Tensor:
        _keep_autocast(ctx, x)
        ctx.save_for_backward(x, weight)
        ctx.settings = group, sequence_parallel, overlap, chunks, dim, ops
        collective = Collective.REDUCE_SCATTER if sequence_parallel else Collective.ALL_REDUCE
        pending = []
        for part in _slices(weight.shape[0], chunks if overlap else 1):
            partial = ops.matmul(x, weight[part].t(), Gemm.FORWARD)
            pending.append(_launch(ops, overlap, collective, partial, group, dim))
        return torch.cat([handle.wait() for handle in pending], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with _forward_autocast(ctx):
            return _RowLinear.gradients(ctx, grad)

    @staticmethod
    def gradients(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        group, sequence_parallel, overlap, chunks, dim, ops = ctx.settings
        if sequence_parallel:  # the reduce-scatter's backward: all-gather dY, slice by slice
            grad_input, grad = _gathered_matmul(grad, weight, group, dim, chunks, overlap,
                                                ops, Gemm.INPUT_GRAD)
        else:
            grad_input = ops.matmul(grad, weight, Gemm.INPUT_GRAD)
        grad_weight = ops.matmul(grad.reshape(-1, grad.shape[-1]).t(),
                                 x.reshape(-1, x.shape[-1]), Gemm.WEIGHT_GRAD)
        return grad_input, grad_weight, None, None, None, None, None, None


def _check_chunks(chunks: int) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"overlap chunks must be an int >= 1, got {chunks!r}")


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor | Sequence[torch.Tensor],
                           group: ProcessGroup | None,
                           *, sequence_parallel: bool = False, overlap: bool = True,
                           chunks: int = 2, dim: int = SEQUENCE_DIM,
                           ops: TensorParallelOps = REAL_OPS) -> torch.Tensor:
    """x Aᵢᵀ for this rank's rows Aᵢ of a column-parallel weight (no bias: add it after).

    `x` is replicated over tp, or with `sequence_parallel` this rank's slice along `dim`
    (the output then has the whole sequence). The input gradient is all-reduced (reduce-
    scattered with sequence parallelism) beside the weight-gradient GEMM when `overlap`.
    `weight` may be given as row blocks (fused q;k;v): one GEMM, their concatenation made
    again in the backward rather than kept."""
    _check_chunks(chunks)
    sequence_parallel = sequence_parallel and tp_rank_and_size(group)[1] > 1
    parts = (weight,) if isinstance(weight, torch.Tensor) else tuple(weight)
    out: torch.Tensor = _ColumnLinear.apply(x, group, sequence_parallel, overlap, chunks,
                                            dim, ops, *parts)
    return out


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup | None, *,
                        sequence_parallel: bool = False, overlap: bool = True,
                        chunks: int = 2, dim: int = SEQUENCE_DIM,
                        ops: TensorParallelOps = REAL_OPS) -> torch.Tensor:
    """Σᵢ xᵢ Bᵢᵀ over tp for this rank's input slice xᵢ and columns Bᵢ (no bias: add it after,
    through `reduce_grad_over_tensor_parallel` with sequence parallelism).

    The sum is all-reduced, or with `sequence_parallel` reduce-scattered along `dim`; with
    `overlap` the output is made in `chunks` column slices, each reduced while the next's
    GEMM runs."""
    _check_chunks(chunks)
    sequence_parallel = sequence_parallel and tp_rank_and_size(group)[1] > 1
    out: torch.Tensor = _RowLinear.apply(x, weight, group, sequence_parallel, overlap, chunks,
                                         dim, ops)
    return out


class _ReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, parameter: torch.Tensor, group: ProcessGroup | None,
                ops: TensorParallelOps) -> torch.Tensor:
        ctx.group, ctx.ops = group, ops
        return parameter.view_as(parameter)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.ops.start(Collective.ALL_REDUCE, grad, ctx.group, 0).wait(), None, None


def reduce_grad(parameter: torch.Tensor, group: ProcessGroup | None,
                ops: TensorParallelOps = REAL_OPS) -> torch.Tensor:
    """`sequence.reduce_grad_over_tensor_parallel` through `ops` (an emulated device times
    the all-reduce too); with the real ops, that function itself."""
    if ops is REAL_OPS:
        return reduce_grad_over_tensor_parallel(parameter, group)
    out: torch.Tensor = _ReduceGrad.apply(parameter, group, ops)
    return out
