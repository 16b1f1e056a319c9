"""The dense HF families' layers on the carried tuple: embedding, positions, block, norm, head.

`pipeline.interop.hf_layers.layers_from_hf` builds its layer lists from these.

Legend of the value between stages: ``(hidden, position_ids)`` or, when the inputs came as
``(input_ids, attention_mask)``, ``(hidden, position_ids, attention_mask)``; while decoding
(`pipeline.runtime.decoding`) ``(hidden, position_ids, attention_mask, cache_rows)``. Every
block rebuilds its causal mask and its rotary ``position_embeddings`` from those: they are
cheap to recompute and carry no gradient, so nothing floating but ``hidden`` is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.interop.hf_decoding import LayerCache, cache_argument, decoding_mask
from pipeline.interop.hf_shared import _embed

__all__ = ["GPT2Positions", "HFBlock", "HFEmbedding", "HFFinalNorm", "SoftCappedHead"]


def _soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma's final logit soft-capping, cap * tanh(logits / cap), as HF computes it."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _tied_head(embedding: nn.Module, hidden: torch.Tensor, *,
               softcap: float | None = None) -> torch.Tensor:
    weight: Any = embedding.weight
    return _soft_cap(F.linear(hidden, weight), softcap)


class SoftCappedHead(nn.Module):
    """An untied lm_head whose logits are soft-capped (Gemma's ``final_logit_softcapping``)."""

    def __init__(self, head: nn.Module, softcap: float) -> None:
        super().__init__()
        self.head = head
        self.softcap = softcap

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _soft_cap(self.head(hidden), self.softcap)


class HFEmbedding(nn.Module):
    """The token embedding (untied): input_ids or (input_ids, mask) in, the tuple out."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding

    @classmethod
    def around(cls, make: Callable[[], nn.Module]) -> HFEmbedding:
        return cls(make())

    def forward(self, x: Any) -> tuple[torch.Tensor, ...]:
        return _embed(self.embedding, x)


class GPT2Positions(nn.Module):
    """GPT-2's learned position embedding added to the token embedding, then dropout."""

    def __init__(self, wpe: nn.Embedding, dropout: float) -> None:
        super().__init__()
        self.wpe = wpe
        self.drop = nn.Dropout(dropout)

    def forward(self, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, positions, *rest = value
        return (self.drop(hidden + self.wpe(positions)), positions, *rest)


class HFBlock(nn.Module):
    """One HF decoder layer on the carried tuple; rebuilds the mask (and rotary) it needs.

    While decoding it keeps the layer's keys and values per group of rows (one
    `LayerCache` per microbatch, keyed by its first row), so a step forwards only the new
    tokens; `reset_decoding_cache` drops them (`pipeline.runtime.decoding` calls it)."""

    def __init__(self, layer: nn.Module, config: Any, mask_function: Callable[..., Any],
                 rotary: nn.Module | None, rotary_layer_type: str | None = None, *,
                 generation_eos: tuple[int, ...] = (),
                 generation_pad: int | None = None) -> None:
        super().__init__()
        self.generation_eos_token_id = generation_eos
        """The EOS ids of the model's generation config (HF's ``generate`` stops on them
        when it is given none): `greedy_generate`'s default."""
        self.generation_pad_token_id = generation_pad
        """The pad id of the model's generation config (HF's ``generate`` fills finished
        rows with it when it is given none; None: the first EOS id, as HF)."""
        self.layer = layer
        self.rotary = rotary
        self.rotary_layer_type = rotary_layer_type
        self.config = config
        self.mask_function = mask_function
        self.cache_argument = cache_argument(layer)
        self._caches: dict[int, LayerCache] = {}

    def reset_decoding_cache(self) -> None:
        self._caches.clear()

    def forward(self, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, positions, *rest = value
        attention_mask = rest[0] if rest else None
        if len(rest) == 2:  # decoding: (mask over past and new tokens, cache rows)
            cache = self._caches.setdefault(int(rest[1][0]), LayerCache())
            mask = decoding_mask(self.mask_function, self.config, hidden, rest[0])
            return (self.attend(hidden, mask, positions, cache), positions, *rest)
        # Positional: the cache argument is `past_key_values` up to transformers 5.18 and
        # `cache` after; both stand fourth.
        mask = self.mask_function(self.config, hidden, attention_mask, None, positions)
        return (self.attend(hidden, mask, positions, None), positions, *rest)

    def attend(self, hidden: torch.Tensor, mask: Any, positions: torch.Tensor,
               cache: LayerCache | None) -> torch.Tensor:
        """The HF decoder layer (attention and MLP) on `hidden`: the one place it is called."""
        extra: dict[str, Any] = {} if cache is None else {self.cache_argument: cache}
        if self.rotary is not None:
            table = (self.rotary(hidden, positions) if self.rotary_layer_type is None
                     else self.rotary(hidden, positions, self.rotary_layer_type))
            extra["position_embeddings"] = table
        out = self.layer(hidden, attention_mask=mask, position_ids=positions, **extra)
        return out[0] if isinstance(out, tuple) else out


class HFFinalNorm(nn.Module):
    """The final norm: the carried tuple in, the normalised hidden states out."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, value: tuple[torch.Tensor, ...]) -> torch.Tensor:
        out: torch.Tensor = self.norm(value[0])
        return out
