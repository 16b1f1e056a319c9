"""Exact attention over the cp group: keys and values all-gathered, queries kept local.

Llama 3's choice for context parallelism with grouped-query attention (Dubey et al. 2024,
§3.3.2): K and V have few heads, so gathering them is cheaper than passing them round a
ring, and the attention is one ordinary (masked) softmax. Backward: the all-gather's
gradient is a reduce-scatter of the K/V gradients over the cp group
(`gather_from_sequence_parallel_region`). The mask is built from global positions: the
rank's query positions against the gathered key positions (`sharding.gathered_positions`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pipeline.errors import PipelineConfigError
from pipeline.parallel.context.ring import ring_attention
from pipeline.parallel.tensor.sequence import gather_from_sequence_parallel_region

__all__ = ["GROUP_ATTRIBUTE", "RING_ATTRIBUTE", "context_mask", "context_parallel_attention"]

GROUP_ATTRIBUTE = "context_parallel_group"
"""The attribute of an attention module holding its cp group (None: cp = 1)."""
RING_ATTRIBUTE = "context_parallel_ring"
"""The attribute of an attention module that, True, runs `ring.ring_attention` instead of
the all-gather."""


def context_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                 padding: torch.Tensor | None = None, window: int | None = None
                 ) -> torch.Tensor:
    """Boolean mask (batch, 1, queries, keys), True where a query may attend to a key:
    causal on global positions, within `window` (Mistral / Qwen2's sliding window: the
    query's position minus the key's below it), and not onto padding (`padding`: the whole
    sequence's 0/1 attention mask). A row allowed nothing (a padding query before any real
    token) attends everywhere instead of producing NaN; it feeds no real token's loss."""
    query = query_positions.reshape(-1, query_positions.shape[-1])[:, None, :, None]
    key = key_positions.reshape(1, 1, 1, -1)
    allowed = key <= query
    if window is not None:
        allowed = allowed & (query - key < window)
    if padding is not None:
        allowed = allowed & padding.bool()[:, key_positions][:, None, None, :]
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def _repeat_heads(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves heads / kv_heads query heads in a
    row (HF's ``repeat_kv``)."""
    return tensor.repeat_interleave(heads // tensor.shape[1], dim=1)


def context_parallel_attention(module: Any, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               dropout: float = 0.0, scaling: float | None = None,
                               **_: Any) -> tuple[torch.Tensor, None]:
    """HF's attention-function signature (query, key, value as (batch, heads, tokens,
    head_dim), after rotary): this rank's queries against every cp rank's keys and values.
    `attention_mask` is `context_mask`'s (this rank's queries × the gathered keys)."""
    group = getattr(module, GROUP_ATTRIBUTE, None)
    heads = query.shape[1]
    if group is not None and getattr(module, RING_ATTRIBUTE, False):
        if attention_mask is None:
            raise ValueError("ring attention needs context_mask's mask (this rank's queries "
                             "against every rank's keys)")
        if dropout:
            raise PipelineConfigError(f"ring attention runs without attention dropout, got "
                                      f"{dropout}; set the config's attention_dropout to 0 "
                                      "or use the all-gather attention")
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = ring_attention(query, key, value, attention_mask, group, scale)
        return out.transpose(1, 2).contiguous(), None
    keys = gather_from_sequence_parallel_region(key, group, dim=2)
    values = gather_from_sequence_parallel_region(value, group, dim=2)
    out = F.scaled_dot_product_attention(
        query, _repeat_heads(keys, heads), _repeat_heads(values, heads),
        attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None
