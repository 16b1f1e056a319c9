"""All-gather attention that keeps only this rank's slice for backward: K/V gathered again there.

Legend: S the sequence, cp the cp size, n = S / cp this rank's tokens, b the batch, a / g the
query / key-value heads, d the head dimension.

Autograd through ``all_gather → SDPA`` keeps the gathered keys and values (2·b·g·S·d) for the
backward of every attention layer, and the dense mask (n·S) SDPA is given: the only saved
tensors that do not shrink with cp (at cp 2 they left a rank 0.551 of cp 1's bytes, not ½).
This function keeps what is this rank's only — its queries, its own keys and values (n
tokens), the output and the per-row log-sum-exp — and in the backward gathers the keys and
values again, rebuilds the mask from the global positions (`mask.PositionMask`: O(S) saved,
not O(n·S)), runs the attention's backward, and reduce-scatters the K/V gradients. Price:
one more K/V all-gather per layer in the backward (`pipeline.planner.context_parallel` counts it).

The kernels and collectives are `ops.ContextParallelOps`' (on CPU the fused SDPA kernel's
own forward / backward pair, exact); none of its collectives is overlapped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from pipeline.parallel.context.mask import PositionMask
from pipeline.parallel.context.ops import ContextParallelOps, TorchContextOps

__all__ = ["gathered_attention"]


def _gather_both(ops: ContextParallelOps, key: torch.Tensor, value: torch.Tensor,
                 group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = ops.start_gather(key, group), ops.start_gather(value, group)
    return keys.wait()[0], values.wait()[0]


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: PositionMask, group: ProcessGroup | None, scale: float,
                ops: ContextParallelOps) -> torch.Tensor:
        keys, values = _gather_both(ops, key, value, group)
        out, lse = ops.attend(query, keys, values, mask.dense(), scale)
        ctx.group, ctx.scale, ctx.mask, ctx.ops = group, scale, mask.without_tensors(), ops
        ctx.save_for_backward(query, key, value, out, lse, *mask.tensors())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, *tensors = ctx.saved_tensors
        ops: ContextParallelOps = ctx.ops
        keys, values = _gather_both(ops, key, value, ctx.group)
        grad_query, grad_keys, grad_values = ops.attend_backward(
            grad, query, keys, values, out, lse, ctx.mask.with_tensors(tensors).dense(),
            ctx.scale)
        grad_key = ops.start_reduce_scatter(grad_keys, ctx.group)
        grad_value = ops.start_reduce_scatter(grad_values, ctx.group)
        return (grad_query, grad_key.wait()[0], grad_value.wait()[0], None, None, None,
                None)


def gathered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: PositionMask, group: ProcessGroup | None, scale: float,
                       ops: ContextParallelOps | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale, `mask`) v, (batch, heads, n, head_dim), of this rank's queries
    against every cp rank's keys and values (gathered in rank order, their own key/value
    heads: grouped-query attention inside the kernel); exact, backward included. `group`
    None: cp = 1 (the gathers are the identity). `ops`: the kernels and collectives
    (default `TorchContextOps()`)."""
    out: torch.Tensor = _GatheredAttention.apply(query, key, value, mask, group, scale,
                                                 ops or TorchContextOps())
    return out
