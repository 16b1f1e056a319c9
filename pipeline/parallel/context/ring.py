"""Ring attention: keys and values passed round the cp group, merged by an online softmax.

Liu et al. 2023 (Ring Attention), with Megatron-Core's causal load balancing. Legend: cp
ranks, step s = 0 .. cp−1; at step s a rank holds the K/V block of cp rank (rank − s) mod
cp, scores its own queries against it under that block's part of the global-position mask
(`mask.context_mask`), and folds the block into a running (output, log-sum-exp) pair
(Milakov & Gimelshein 2018):

    lse' = logaddexp(lse, lse_b)        out' = out · e^(lse − lse') + out_b · e^(lse_b − lse')

Overlap (`overlap=True`, the default): the pass of the block for step s+1 is launched
before the block of step s is computed and waited after it, so a pass costs only what it
exceeds the block's computation by:

    forward, step s:   start pass(K, V → next)   attend(q, block s)   merge   wait pass
    backward, step s:  start pass(K, V → next)   attend_backward(block s)     wait pass

The backward passes the K/V blocks round again (only this rank's own are kept: the same
bytes as the all-gather attention keeps), takes each block's exact share of the gradients
from the final output and log-sum-exp (`ops.TorchContextOps.attend_backward`), collects
the blocks' K/V gradients in rank order and reduce-scatters them once at the end (not
overlapped). Without overlap every pass is waited as soon as it is launched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from pipeline.parallel.context.mask import PositionMask
from pipeline.parallel.context.ops import MASKED, SEQUENCE_DIM, ContextParallelOps, TorchContextOps

__all__ = ["MASKED", "ring_attention"]


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online softmax's fold of one block into the running (output, log-sum-exp)."""
    merged = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - merged)[..., None]
            + block_out * torch.exp(block_lse - merged)[..., None]), merged


def _block_mask(allowed: torch.Tensor, source: int, tokens: int) -> torch.Tensor:
    return allowed[..., source * tokens:(source + 1) * tokens]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: PositionMask, group: ProcessGroup, scale: float, overlap: bool,
                ops: ContextParallelOps) -> torch.Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        tokens, allowed = key.shape[SEQUENCE_DIM], mask.dense()
        out = torch.zeros_like(query)
        lse = torch.full(query.shape[:-1], MASKED, dtype=query.dtype, device=query.device)
        block = [key, value]
        for step in range(size):
            pending = ops.start_pass(block, group) if step < size - 1 else None
            if pending is not None and not overlap:
                block_next = pending.wait()
            source = (rank - step) % size  # whose block this rank holds at this step
            block_out, block_lse = ops.attend(query, block[0], block[1],
                                              _block_mask(allowed, source, tokens), scale)
            out, lse = _merge(out, lse, block_out, block_lse)
            if pending is not None:
                block = pending.wait() if overlap else block_next
        ctx.group, ctx.scale, ctx.overlap, ctx.ops = group, scale, overlap, ops
        ctx.mask = mask.without_tensors()
        ctx.save_for_backward(query, key, value, out, lse, *mask.tensors())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, *tensors = ctx.saved_tensors
        group, ops, overlap = ctx.group, ctx.ops, ctx.overlap
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        tokens = key.shape[SEQUENCE_DIM]
        allowed = ctx.mask.with_tensors(tensors).dense()
        grad_query = torch.zeros_like(query)
        grad_keys: dict[int, torch.Tensor] = {}  # by source rank
        grad_values: dict[int, torch.Tensor] = {}
        block = [key, value]
        for step in range(size):
            pending = ops.start_pass(block, group) if step < size - 1 else None
            if pending is not None and not overlap:
                block_next = pending.wait()
            source = (rank - step) % size
            share = ops.attend_backward(grad, query, block[0], block[1], out, lse,
                                        _block_mask(allowed, source, tokens), ctx.scale)
            grad_query = grad_query + share[0]
            grad_keys[source], grad_values[source] = share[1], share[2]
            if pending is not None:
                block = pending.wait() if overlap else block_next
        # every rank's share of every block's K/V gradient, summed onto the block's owner
        grad_key = ops.start_reduce_scatter(
            torch.cat([grad_keys[r] for r in range(size)], SEQUENCE_DIM), group)
        grad_value = ops.start_reduce_scatter(
            torch.cat([grad_values[r] for r in range(size)], SEQUENCE_DIM), group)
        return (grad_query, grad_key.wait()[0], grad_value.wait()[0], None, None, None, None,
                None)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mask: PositionMask, group: ProcessGroup, scale: float, *,
                   overlap: bool = True, ops: ContextParallelOps | None = None
                   ) -> torch.Tensor:
    """softmax(q kᵀ · scale, `mask`) v, (batch, heads, n, head_dim), over every cp rank's
    keys and values, passed round the ring with their own (key/value) heads; `mask` is
    this rank's queries against the gathered order of keys (rank 0's tokens, then rank
    1's, ...). `overlap`: each pass runs beside a block's computation (module docstring).
    `ops`: the kernels and messages (default `TorchContextOps()`)."""
    out: torch.Tensor = _RingAttention.apply(query, key, value, mask, group, scale, overlap,
                                             ops or TorchContextOps())
    return out
