"""All-gather attention that keeps only this rank's slice for backward: K/V gathered again there.

Legend: S the sequence, cp the cp size, n = S / cp this rank's tokens, b the batch, a / g the
query / key-value heads, d the head dimension.

Autograd through ``all_gather → SDPA`` keeps the gathered keys and values (2·b·g·S·d) for the
backward of every attention layer, and the dense mask (n·S) SDPA is given: the only saved
tensors that do not shrink with cp (at cp 2 they left a rank 0.551 of cp 1's bytes, not ½).
As Transformer Engine's ``AttnFuncWithCPAndKVAllGather`` does, this function keeps what
is this rank's only — its queries, its own keys and values (n tokens), the output and the
per-row log-sum-exp — and in the backward gathers the keys and values again, rebuilds the
mask from the global positions (`mask.PositionMask`: O(S) saved, not O(n·S)), runs the
attention's backward, and reduce-scatters the K/V gradients. Price: one more K/V all-gather
per layer in the backward (`pipeline.planner.context_parallel` counts it).

On CPU the forward and backward are the fused SDPA kernel's own pair
(``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, exact); elsewhere the
backward recomputes the attention core under autograd (one more attention forward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from pipeline.parallel.context.mask import PositionMask
from pipeline.parallel.tensor.sequence import start_all_gather, start_reduce_scatter

__all__ = ["gathered_attention"]

_HEAD_DIM_SEQUENCE = 2
"""(batch, heads, tokens, head_dim): the dimension the sequence is gathered along."""


def _gather(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    return start_all_gather(tensor, group, _HEAD_DIM_SEQUENCE, async_op=False).wait()


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean mask as SDPA's fused CPU kernel takes it: 0 where allowed, −inf elsewhere
    (every row allows a key: `attention.context_mask`)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, float("-inf"))


def _fused(query: torch.Tensor) -> bool:
    """Whether the fused CPU kernel pair runs (CPU tensors), else the recomputing backward."""
    return query.device.type == "cpu" and _FUSED_ON_CPU


_FUSED_ON_CPU = True
"""Tests set it False to run the device-generic (recomputing) backward on CPU."""


class _GatheredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: PositionMask, group: ProcessGroup | None, scale: float) -> torch.Tensor:
        keys, values = _gather(key, group), _gather(value, group)
        allowed = mask.dense()
        if _fused(query):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, keys, values, 0.0, False, attn_mask=_additive(allowed, query.dtype),
                scale=scale)
        else:
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed,
                                                 scale=scale, enable_gqa=True)
            lse = out.new_empty(0)
        ctx.group, ctx.scale, ctx.mask = group, scale, mask.without_tensors()
        ctx.save_for_backward(query, key, value, out, lse, *mask.tensors())
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, out, lse, *tensors = ctx.saved_tensors
        keys, values = _gather(key, ctx.group), _gather(value, ctx.group)
        allowed = ctx.mask.with_tensors(tensors).dense()
        if _fused(query):
            grad_query, grad_keys, grad_values = \
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                    grad.contiguous(), query, keys, values, out, lse, 0.0, False,
                    attn_mask=_additive(allowed, query.dtype), scale=ctx.scale)
        else:
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_() for t in (query, keys, values)]
                again = F.scaled_dot_product_attention(inputs[0], inputs[1], inputs[2],
                                                       attn_mask=allowed, scale=ctx.scale,
                                                       enable_gqa=True)
                grad_query, grad_keys, grad_values = torch.autograd.grad(again, inputs, grad)
        grad_key = start_reduce_scatter(grad_keys, ctx.group, _HEAD_DIM_SEQUENCE,
                                        async_op=False).wait()
        grad_value = start_reduce_scatter(grad_values, ctx.group, _HEAD_DIM_SEQUENCE,
                                          async_op=False).wait()
        return grad_query, grad_key, grad_value, None, None, None


def gathered_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: PositionMask, group: ProcessGroup | None, scale: float
                       ) -> torch.Tensor:
    """softmax(q kᵀ · scale, `mask`) v, (batch, heads, n, head_dim), of this rank's queries
    against every cp rank's keys and values (gathered in rank order, their own key/value
    heads: grouped-query attention inside the kernel); exact, backward included. `group`
    None: cp = 1 (the gathers are the identity)."""
    out: torch.Tensor = _GatheredAttention.apply(query, key, value, mask, group, scale)
    return out
