"""Tiny models and batches shared by the runtime tests (built identically in every rank)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipeline import LayerSpec

__all__ = ["MODELS", "Boom", "ModelCase", "mlp_layers", "transformer_layers"]

WIDTH = 8
VOCAB = 11


def mlp_layers() -> list[Any]:
    """8 × (Linear, tanh): 16 layers, enough for p=4, v=2."""
    layers: list[Any] = []
    for _ in range(8):
        layers += [LayerSpec(nn.Linear, WIDTH, WIDTH), torch.tanh]
    return layers


class Embed(nn.Module):
    """Token ids -> (hidden, padding mask): the mask is a bool tensor riding along."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embedding(ids), ids == 0


class Block(nn.Module):
    """A transformer encoder block on (hidden, mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=16, dropout=0.0,
                                                batch_first=True)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, mask = value
        return self.layer(hidden, src_key_padding_mask=mask), mask


class Head(nn.Module):
    """(hidden, mask) -> logits."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, VOCAB)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.proj(value[0])


def transformer_layers() -> list[Any]:
    """Embedding, 6 blocks, head: 8 layers."""
    return [LayerSpec(Embed)] + [LayerSpec(Block) for _ in range(6)] + [LayerSpec(Head)]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def mlp_batch(seed: int, batch: int = 24, length: int = 0) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, WIDTH, generator=generator),
            torch.randn(batch, WIDTH, generator=generator))


def transformer_batch(seed: int, batch: int = 24, length: int = 5) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    ids[::3, -1] = 0  # some padding, never a fully padded row
    return ids, torch.randint(0, VOCAB, (batch, length), generator=generator)


class ModelCase:
    """How to build one test model and its batches."""

    def __init__(self, layers: Callable[[], list[Any]], loss: Callable[..., torch.Tensor],
                 batch: Callable[..., tuple[Any, Any]], lengths: tuple[int, ...]) -> None:
        self.layers = layers
        self.loss = loss
        self.batch = batch
        self.lengths = lengths
        """Sequence length of each training step (varies between steps for the transformer)."""


MODELS = {
    "mlp": ModelCase(mlp_layers, F.mse_loss, mlp_batch, (0,)),
    "transformer": ModelCase(transformer_layers, token_loss, transformer_batch, (5, 7)),
}


class Boom(nn.Module):
    """Identity that raises on its `fail_on`-th call (counting from 1): a rank failing mid-step."""

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError(f"Boom: injected failure on call {self.calls}")
        return x


class Stall(nn.Module):
    """Identity that sleeps `seconds` on its first call: a rank that stops answering."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return x


def v_split_schedule(num_microbatches: int) -> Any:
    """A hand-made 2-rank V-placement schedule with split backwards (I then W): rank 0 holds
    stages 0 and 3, rank 1 stages 1 and 2, so 1 -> 2 passes activations and gradients on
    one rank. Order per rank: forwards of its upstream then downstream stage, input grads
    downstream then upstream, weight grads last."""
    from schedules import Instruction, Kind, Schedule, v_placement

    m = range(num_microbatches)

    def ops(kind: Kind, stage: int) -> list[Instruction]:
        return [Instruction(kind, stage, i) for i in m]

    streams = (
        tuple(ops(Kind.F, 0) + ops(Kind.F, 3) + ops(Kind.I, 3) + ops(Kind.I, 0)
              + ops(Kind.W, 3) + ops(Kind.W, 0)),
        tuple(ops(Kind.F, 1) + ops(Kind.F, 2) + ops(Kind.I, 2) + ops(Kind.I, 1)
              + ops(Kind.W, 2) + ops(Kind.W, 1)),
    )
    return Schedule("v-split", num_microbatches, v_placement(2), streams)
