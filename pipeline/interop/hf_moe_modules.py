"""The MoE families' layers and losses on the carried tuple: embedding, block, norm, head.

`pipeline.interop.hf_moe.moe_layers_from_hf` builds its layer lists from these.

Legend of the value between stages: ``(hidden, balance, position_ids[, attention_mask])``;
``balance`` is a one-element fp32 tensor (1-d, so eval outputs join over microbatches),
the load-balancing loss the MoE layers upstream added for this microbatch
(`pipeline.moe.balance_loss`); it rides with the activations (and its gradient back) to the
loss, which adds it to the language-model loss as HF does when the config sets
``output_router_logits``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.interop.hf_shared import IGNORE_INDEX, _embed, causal_lm_loss
from pipeline.moe.layer import MoEFeedForward
from pipeline.runtime.loss_normalization import SummedLoss, token_cross_entropy

__all__ = ["BalancedSummedLoss", "MoEBlock", "MoEEmbedding", "MoEFinalNorm", "MoEHead",
           "moe_causal_lm_loss"]


# -- the layers -----------------------------------------------------------------------------

def _with_balance(value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    hidden, positions, *rest = value
    return (hidden, hidden.new_zeros(1, dtype=torch.float32), positions, *rest)


def _moe_embed(embedding: nn.Module, x: Any) -> tuple[torch.Tensor, ...]:
    return _with_balance(_embed(embedding, x))


class MoEEmbedding(nn.Module):
    """The token embedding (untied): input_ids or (input_ids, mask) in, the tuple out."""

    row_sums = (1,)
    """Position 1 of the carried tuple is the balancing loss, a sum over the rows: a
    two-batch forward's halves add theirs (`pipeline.runtime.two_batch`)."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: Any) -> tuple[torch.Tensor, ...]:
        return _moe_embed(self.embedding, x)


class MoEBlock(nn.Module):
    """One HF decoder layer on the carried tuple: attention, then its MLP or MoE, adding the
    MoE's balancing-loss share to the carried scalar. (Training and evaluation; the KV-cache
    decoding of `pipeline.runtime.decoding` is not wired for MoE families.)"""

    row_sums = (1,)
    """Position 1 of the carried tuple is the balancing loss, a sum over the rows: a
    two-batch forward's halves add theirs (`pipeline.runtime.two_batch`)."""

    def __init__(self, layer: nn.Module, config: Any, mask_function: Callable[..., Any],
                 rotary: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.config = config
        self.mask_function = mask_function

    def forward(self, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        hidden, balance, positions, *rest = value
        attention_mask = rest[0] if rest else None
        mask = self.mask_function(self.config, hidden, attention_mask, None, positions)
        layer: Any = self.layer
        attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden),
                                      position_embeddings=self.rotary(hidden, positions),
                                      attention_mask=mask, position_ids=positions)
        hidden = hidden + attended
        normed = layer.post_attention_layernorm(hidden)
        if isinstance(layer.mlp, MoEFeedForward):
            mixed, share = layer.mlp(normed, self.routed_mask(attention_mask))
            balance = balance + share
        else:
            mixed = layer.mlp(normed)
        return (hidden + mixed, balance, positions, *rest)

    def routed_mask(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The padding mask of the tokens the MoE layer routes (all the block holds here;
        under context parallelism the rank's chunks of the whole-sequence mask)."""
        return attention_mask


class MoEFinalNorm(nn.Module):
    """The final norm: the carried tuple in, (normalised hidden, balance) out."""

    row_sums = (1,)
    """Position 1 of the carried tuple is the balancing loss, a sum over the rows: a
    two-batch forward's halves add theirs (`pipeline.runtime.two_batch`)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, value: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(value[0]), value[1]


class MoEHead(nn.Module):
    """The untied lm_head: (hidden, balance) -> (logits, balance)."""

    row_sums = (1,)
    """Position 1 of the carried tuple is the balancing loss, a sum over the rows: a
    two-batch forward's halves add theirs (`pipeline.runtime.two_batch`)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(value[0]), value[1]


def _tied_moe_head(embedding: nn.Module, value: tuple[torch.Tensor, torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    weight: Any = embedding.weight
    return F.linear(value[0], weight), value[1]


# -- the losses -----------------------------------------------------------------------------

def moe_causal_lm_loss(outputs: tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor
                       ) -> torch.Tensor:
    """HF's causal-LM loss of the logits plus the carried balancing loss."""
    return causal_lm_loss(outputs[0], labels) + outputs[1].sum()


class BalancedSummedLoss(SummedLoss):
    """`token_cross_entropy` (summed, counted, scaled per step) plus the balancing loss,
    which `BalanceLoss` already scales for the engine's normalisation."""

    def __init__(self) -> None:
        tokens = token_cross_entropy(ignore_index=IGNORE_INDEX, shift=True)
        super().__init__(tokens.loss_sum, tokens.count, tokens.name + " + balancing loss")

    def __call__(self, outputs: Any, targets: Any) -> torch.Tensor:
        return self.loss_sum(outputs[0], targets) * self.scale + outputs[1].sum()
