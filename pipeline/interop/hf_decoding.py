"""A HF decoder layer's key/value cache across decoding steps, and its mask for the new tokens.

Each `HFBlock` keeps its own layer's keys and values (one `LayerCache` per microbatch), so
the cache of a stage lives on the rank that runs it and only the new tokens' hidden states
travel between ranks. Why not one HF ``DynamicCache`` per stage: HF sizes a step's mask from
the cache's first full-attention layer, which may sit on another rank; a cache per layer
that answers only ``update`` (what HF's attention modules call) keeps each layer exact.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["LayerCache", "cache_argument", "decoding_mask"]


class LayerCache:
    """Keys and values one decoder layer has seen for one group of rows.

    Duck-types the one method HF's attention modules call on a cache,
    ``update(keys, values, layer_idx, ...) -> (all keys, all values)``; the layer index
    is the layer's own, so it is ignored."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys and values (batch, heads, new tokens, head dim)."""
        if self.keys is None or self.values is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached so far."""
        return 0 if self.keys is None else int(self.keys.shape[-2])


def cache_argument(layer: nn.Module) -> str:
    """The keyword a HF decoder layer takes its cache by: ``cache`` from transformers 5.19
    (``past_key_values`` is deprecated there, removed in 5.40), ``past_key_values`` before."""
    parameters = inspect.signature(layer.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def decoding_mask(mask_function: Callable[..., Any], config: Any, hidden: torch.Tensor,
                  attention_mask: torch.Tensor) -> Any:
    """The mask of `hidden`'s q new tokens over all kv tokens seen (past and new).

    `attention_mask` (batch, kv) marks real tokens (0 for left padding). HF's own mask
    function builds the kv x kv mask of the whole sequence (causal, sliding window, padding,
    in the attention implementation's format); its last q rows are the new tokens'. A None
    (sdpa may skip a plain causal mask) stays None: with q == kv the attention applies
    ``is_causal`` itself, and a single new token may see every kv token."""
    batch, new = hidden.shape[:2]
    whole = hidden.new_empty((batch, attention_mask.shape[1], 0))
    mask = mask_function(config, whole, attention_mask, None, None)
    return None if mask is None else mask[..., -new:, :]
