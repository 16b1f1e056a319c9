"""A Llama-shaped decoder (RMSNorm, rotary positions, grouped-query attention through
`scaled_dot_product_attention`, SwiGLU MLP, untied head) as pipeline layers, self-contained so
the GPU check needs nothing but torch on the GPU machine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec

__all__ = ["TINYLLAMA_1B", "LlamaShape", "llama_layers", "token_loss"]


@dataclass(frozen=True)
class LlamaShape:
    """Sizes of the decoder (TinyLlama-1.1B's by default: 1.10 B parameters)."""

    vocab: int = 32000
    hidden: int = 2048
    layers: int = 22
    heads: int = 32
    kv_heads: int = 4
    ffn: int = 5632
    seq: int = 2048

    def parameters(self) -> int:
        head = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head
        block = attention + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * block + 2 * self.vocab * self.hidden + self.hidden

    def planner_model(self) -> str:
        """The same shape as `pipesched plan --model` writes it."""
        return (f"layers={self.layers},hidden={self.hidden},heads={self.heads},"
                f"vocab={self.vocab},seq={self.seq},ffn={self.ffn},kv_heads={self.kv_heads},"
                f"mlp=swiglu,tied_embeddings=false")


TINYLLAMA_1B = LlamaShape()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Block(nn.Module):
    """Pre-norm attention and SwiGLU MLP with residuals."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        head = shape.hidden // shape.heads
        self.attention_norm = nn.RMSNorm(shape.hidden, eps=1e-5)
        self.q = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.kv = nn.Linear(shape.hidden, 2 * shape.kv_heads * head, bias=False)
        self.o = nn.Linear(shape.hidden, shape.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(shape.hidden, eps=1e-5)
        self.gate_up = nn.Linear(shape.hidden, 2 * shape.ffn, bias=False)
        self.down = nn.Linear(shape.ffn, shape.hidden, bias=False)
        inverse = 1.0 / 10000 ** (torch.arange(0, head, 2).float() / head)
        angles = torch.outer(torch.arange(shape.seq).float(), inverse).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads, kv_heads = self.shape.heads, self.shape.kv_heads
        head = self.shape.hidden // heads
        h = self.attention_norm(x)
        q = self.q(h).view(b, s, heads, head).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, kv_heads, head).permute(2, 0, 3, 1, 4)
        cos, sin = self.cos[:s].to(q.dtype), self.sin[:s].to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(attention.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Head(nn.Module):
    """Final RMSNorm and the untied output projection."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(shape.hidden, eps=1e-5)
        self.proj = nn.Linear(shape.hidden, shape.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def llama_layers(shape: LlamaShape) -> list[Any]:
    """Embedding, `shape.layers` blocks, head: each a `LayerSpec` built where it runs."""
    return [LayerSpec(nn.Embedding, shape.vocab, shape.hidden),
            *(LayerSpec(Block, shape) for _ in range(shape.layers)), LayerSpec(Head, shape)]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
