"""A small decoder-only transformer language model as pipeline layers, and its training data.

Used by `pipesched train` (the demo) and the benchmarks. Every layer is a `LayerSpec`, so a
rank builds only the layers it owns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.layers import LayerSpec
from pipeline.model.recompute import recompute_region
from schedules.ir.schedule import count_problem

__all__ = ["Attention", "DecoderBlock", "LMHead", "TinyLMConfig", "TokenEmbedding", "lm_layers",
           "lm_loss", "synthetic_batch"]

Attention = Literal["fused", "eager"]
"""fused: `scaled_dot_product_attention`, which keeps no s × s scores for the backward (a
FlashAttention-style kernel); eager: softmax(QKᵀ/√d)·V as plain ops, keeping the scores."""


@dataclass(frozen=True, kw_only=True)
class TinyLMConfig:
    """Sizes of the demo language model."""

    vocab: int = 64
    """Tokens in the vocabulary."""
    width: int = 64
    """Hidden size."""
    heads: int = 4
    """Attention heads per block; must divide `width`."""
    blocks: int = 8
    """Decoder blocks between the embedding and the head."""
    seq_len: int = 32
    """Longest sequence (positions are learned up to it)."""
    attention: Attention = "fused"
    """How the blocks compute attention's core (see `Attention`)."""

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "heads", "blocks", "seq_len"):
            problem = count_problem(name, getattr(self, name))
            if problem is not None:
                raise ValueError(problem)
        if self.width % self.heads:
            raise ValueError(f"heads={self.heads} must divide width={self.width}")
        if self.attention not in get_args(Attention):
            raise ValueError(f"attention must be one of {get_args(Attention)}, got "
                             f"{self.attention!r}")


class TokenEmbedding(nn.Module):
    """Token ids (batch, length) -> hidden states with learned positions."""

    def __init__(self, vocab: int, width: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq_len, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and a GELU MLP, each with a residual.

    Attention's core (softmax(QKᵀ/√d)·V) is the block's `recompute_region`: selective
    recomputation (``PipelineModule(..., recompute="selective")``) keeps its inputs Q, K, V
    only and redoes it in the backward (Korthikanti et al. 2022, section 4.2).
    """

    def __init__(self, width: int, heads: int, attention: Attention = "fused") -> None:
        super().__init__()
        if attention not in get_args(Attention):
            raise ValueError(f"attention must be one of {get_args(Attention)}, got "
                             f"{attention!r}")
        self.heads = heads
        self.eager = attention == "eager"
        self.attention_norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length, width = hidden.shape
        # the projections of `self.attention` (an nn.MultiheadAttention, for its parameter
        # names), with the core between them as a separate, recomputable region
        qkv = F.linear(self.attention_norm(hidden), self.attention.in_proj_weight,
                       self.attention.in_proj_bias)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2)
                   for t in qkv.chunk(3, dim=-1))
        core = recompute_region(self._core, q, k, v)
        attended = self.attention.out_proj(core.transpose(1, 2).reshape(batch, length, width))
        hidden = hidden + attended
        return hidden + self.mlp(self.mlp_norm(hidden))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal softmax(QKᵀ/√d)·V per head."""
        if not self.eager:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        length = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=q.device), 1)
        return scores.masked_fill(causal, float("-inf")).softmax(dim=-1) @ v


class LMHead(nn.Module):
    """Final norm and the projection to vocabulary logits."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, vocab)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(hidden))


def lm_layers(config: TinyLMConfig) -> list[Any]:
    """Embedding, `blocks` decoder blocks and the head: blocks + 2 pipeline layers."""
    return ([LayerSpec(TokenEmbedding, config.vocab, config.width, config.seq_len)]
            + [LayerSpec(DecoderBlock, config.width, config.heads, config.attention)
               for _ in range(config.blocks)]
            + [LayerSpec(LMHead, config.width, config.vocab)])


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(step: int, batch: int, config: TinyLMConfig, *, seed: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets for one step, the same on every rank.

    Each sequence counts up from a random start by a random stride (mod vocab), so the
    next token follows from the previous two: learnable, and the loss falls visibly in a
    few dozen steps. Nothing is downloaded.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, config.vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 5, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(config.seq_len + 1)) % config.vocab
    return tokens[:, :-1], tokens[:, 1:]
