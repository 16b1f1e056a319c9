"""A small decoder-only transformer language model as pipeline layers, and its training data.

Used by `pipesched train` (the demo) and the benchmarks. Every layer is a `LayerSpec`, so a
rank builds only the layers it owns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.layers import LayerSpec
from schedules.ir.schedule import count_problem

__all__ = ["DecoderBlock", "LMHead", "TinyLMConfig", "TokenEmbedding", "lm_layers", "lm_loss",
           "synthetic_batch"]


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

    def __post_init__(self) -> None:
        for name in ("vocab", "width", "heads", "blocks", "seq_len"):
            problem = count_problem(name, getattr(self, name))
            if problem is not None:
                raise ValueError(problem)
        if self.width % self.heads:
            raise ValueError(f"heads={self.heads} must divide width={self.width}")


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
    """Pre-norm causal self-attention and a GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        length = hidden.shape[1]
        causal = torch.triu(torch.ones(length, length, dtype=torch.bool, device=hidden.device), 1)
        normed = self.attention_norm(hidden)
        attended, _ = self.attention(normed, normed, normed, attn_mask=causal, need_weights=False)
        hidden = hidden + attended
        return hidden + self.mlp(self.mlp_norm(hidden))


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
            + [LayerSpec(DecoderBlock, config.width, config.heads) for _ in range(config.blocks)]
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
