"""Exact attention over the cp group: keys and values all-gathered, queries kept local.

Llama 3's choice for context parallelism with grouped-query attention (Dubey et al. 2024,
§3.3.2): K and V have few heads, so gathering them is cheaper than passing them round a
ring, and the attention is one ordinary (masked) softmax. The mask comes as global positions
(`mask.PositionMask`: the rank's query positions against the gathered key positions,
`sharding.gathered_positions`). Without attention dropout `gathered.gathered_attention` runs
it, keeping only this rank's slice for the backward (K/V gathered again there); with dropout
autograd runs through the all-gather (its gradient a reduce-scatter) and SDPA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pipeline.errors import PipelineConfigError
from pipeline.parallel.context.gathered import gathered_attention
from pipeline.parallel.context.mask import PositionMask, context_mask
from pipeline.parallel.context.ring import ring_attention
from pipeline.parallel.tensor.sequence import gather_from_sequence_parallel_region

__all__ = ["GROUP_ATTRIBUTE", "OPS_ATTRIBUTE", "RING_ATTRIBUTE", "context_mask",
           "context_parallel_attention"]

GROUP_ATTRIBUTE = "context_parallel_group"
"""The attribute of an attention module holding its cp group (None: cp = 1)."""
RING_ATTRIBUTE = "context_parallel_ring"
"""The attribute of an attention module that, True, runs `ring.ring_attention` instead of
the all-gather."""
OPS_ATTRIBUTE = "context_parallel_ops"
"""The attribute of an attention module holding its `ops.ContextParallelOps` (absent: the
real kernels and messages; `pipeline.rehearsal.emulated_cp` sets timed ones)."""


def _repeat_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves heads / kv_heads query heads in a
    row (HF's ``repeat_kv``)."""
    return tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def context_parallel_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: PositionMask | None,
                               dropout: float = 0.0, scaling: float | None = None,
                               **_: Any) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature (query, key, value as (batch, heads, tokens,
    head_dim), after rotary): this rank's queries against every cp rank's keys and values.
    `attention_mask` is `ContextMask`'s `PositionMask` (this rank's queries × the gathered
    keys)."""
    if not isinstance(attention_mask, PositionMask):
        raise ValueError(f"context-parallel attention needs a PositionMask (ContextMask's, "
                         f"this rank's queries against every rank's keys), got "
                         f"{type(attention_mask).__name__}")
    group = getattr(module, GROUP_ATTRIBUTE, None)
    ops = getattr(module, OPS_ATTRIBUTE, None)
    heads = query.shape[1]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if group is not None and getattr(module, RING_ATTRIBUTE, False):
        if dropout:
            raise PipelineConfigError(f"ring attention runs without attention dropout, got "
                                      f"{dropout}; set the config's attention_dropout to 0 "
                                      "or use the all-gather attention")
        out = ring_attention(query, key, value, attention_mask, group, scale, ops=ops)
    elif not dropout:
        out = gathered_attention(query, key, value, attention_mask, group, scale, ops)
    else:
        keys = gather_from_sequence_parallel_region(key, group, dim=2)
        values = gather_from_sequence_parallel_region(value, group, dim=2)
        out = F.scaled_dot_product_attention(
            query, _repeat_heads(keys, heads), _repeat_heads(values, heads),
            attn_mask=attention_mask.dense(), dropout_p=dropout, scale=scale)
    return out.transpose(1, 2).contiguous(), None
