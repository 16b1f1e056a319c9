"""Ring attention: keys and values passed round the cp group, merged by an online softmax.

Liu et al. 2023 (Ring Attention), with Megatron-Core's causal load balancing: at step s a
rank holds the K/V block of cp rank (rank − s) mod cp, scores its own queries against it
under that block's part of the global-position mask (`attention.context_mask`), and folds
the block into a running (output, log-sum-exp) pair (Milakov & Gimelshein 2018):

    lse' = logaddexp(lse, lse_b)        out' = out · e^(lse − lse') + out_b · e^(lse_b − lse')

The pass is an autograd function (send to the next rank, receive from the previous; its
backward the reverse), so the backward runs the ring the other way through autograd: exact,
but it keeps every block's probabilities like the all-gather keeps the gathered K/V.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["ring_attention"]


def _shift(tensor: torch.Tensor, group: ProcessGroup, forward: bool) -> torch.Tensor:
    """Send `tensor` to the next cp rank and receive the previous one's (backward: the
    other way round)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to, source = ((rank + 1) % size, (rank - 1) % size) if forward else \
        ((rank - 1) % size, (rank + 1) % size)
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, to),
                      group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, source), group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


class _RingPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _shift(tensor, group, forward=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _shift(grad, ctx.group, forward=False), None


MASKED = -1e30
"""The score of a masked pair: finite, so a block with nothing allowed for a row merges with
weight e^(MASKED − lse) = 0 once a real block comes (every row has one: `context_mask`), and
no −inf − (−inf) = NaN reaches a gradient."""


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           allowed: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This block's softmax-weighted values and log-sum-exp per query (grouped-query
    attention: each key/value head serves heads / kv_heads query heads in a row)."""
    repeat = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~allowed, MASKED)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ value, lse


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mask: torch.Tensor, group: ProcessGroup, scale: float) -> torch.Tensor:
    """softmax(q kᵀ · scale, `mask`) v over every cp rank's keys and values, passed round the
    ring with their own (key/value) heads. `mask` is this rank's queries against the
    gathered order of keys (rank 0's tokens, then rank 1's, ...)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    tokens = key.shape[-2]
    out = torch.zeros_like(query)
    lse = torch.full((*query.shape[:-1], 1), MASKED, dtype=query.dtype, device=query.device)
    for step in range(size):
        if step:
            key, value = _RingPass.apply(key, group), _RingPass.apply(value, group)
        source = (rank - step) % size  # whose block this rank holds at this step
        allowed = mask[..., source * tokens:(source + 1) * tokens]
        block_out, block_lse = _block(query, key, value, allowed, scale)
        merged = torch.logaddexp(lse, block_lse)
        out = out * torch.exp(lse - merged) + block_out * torch.exp(block_lse - merged)
        lse = merged
    return out
